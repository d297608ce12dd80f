"""The EAGLE-3 drafter: model (model.py), training phase (train.py), checkpoints, export for servers."""
