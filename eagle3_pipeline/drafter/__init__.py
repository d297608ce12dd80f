"""The EAGLE-3 drafter: the draft network (model/), the ``train`` phase (train/), the ``evaluate`` phase
(evaluate/), the formats servers load (export/) and the drafter served and benchmarked (serve/)."""
