"""Processes and their coordination: collectives over a process group (distributed.py), FSDP2
sharding (sharding.py), launching through accelerate on one machine or several (launch.py,
launch_check.py), a child's lifeline to its parent (lifeline.py) and whole process trees run to the
end or killed (subprocesses.py)."""
