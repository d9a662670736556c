"""record_samples.py's run with each of torchrun's attempts on a node writing files of its own,
``<dump_folder>/samples-attempt<A>-rank<R>.jsonl`` (A: the node's TORCHELASTIC_RESTART_COUNT), so that
the batches of an attempt cut short can be told from those of the next.

Usage: torchrun --nproc-per-node N tests/distributed/record_attempt_samples.py <train.py arguments>
"""

from __future__ import annotations

import os
import sys

from tests.distributed.record_samples import main

if __name__ == "__main__":
    main(sys.argv[1:], file_prefix=f"samples-attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-")
