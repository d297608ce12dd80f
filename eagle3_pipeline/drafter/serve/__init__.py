"""The drafter on a real server: the online benchmark (`drafter_benchmark`) and the relaunch (`served_drafter`)."""
