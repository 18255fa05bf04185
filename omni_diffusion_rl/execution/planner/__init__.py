"""auto's planning, in one place: unit costs (costs.py: the model and its one file reader; measure.py:
timed here), the discrete-event simulator of every mode (simulate.py), the one rule that picks a
mode and the one that switches (pick.py), the run-time re-check (recheck.py) and the driver that
runs the picked mode and switches (auto.py)."""
