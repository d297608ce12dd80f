"""The EAGLE-3 drafter: model, training, export, and acceptance evaluation."""
