"""Benchmarks behind `odrl bench`: each module runs one and writes a JSON report (and a plot).

* `nft_step`: one DiffusionNFT optimizer step against a plain flow-matching step;
* `reward_server`: a reward server's batching and its client overhead;
* `modes`: the execution modes with 2 processes, against the simulator's prediction;
* `learning`: held-out reward per execution mode over seeds, against colocated;
* `recheck`: auto's re-check after a wrong first pick, and its cost;
* `common`: what they share (launching a 2-process training run, publishing a report).

Nothing is imported here: `odrl bench NAME` imports only the module it runs.
"""
