"""Does each phase fit the machine: GPU memory per GPU, host memory, disk and time, predicted from the target's
checkpoint, the engines' budget rules and the machine (declared or read live), before hours are spent."""
