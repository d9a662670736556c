"""Runs torchtitan through its CPU launcher with one more llama3 model size registered.

    torchrun ... bench/titan_flavor.py LAUNCHER NAME FIELDS [torchtitan's options]

torchtitan looks its model sizes up by name (``--model.flavor``) in ``llama3_args``; NAME becomes
a copy of its debug model with the fields of the JSON object FIELDS changed (e.g.
``{"dim": 1024, "n_layers": 4}``), so that ``bench/vs_torchtitan.py`` can run a model torchtitan
does not name at the same dimensions as Tessera's flavor of that name. The launcher's patches run
first: they must precede torchtitan's imports.
"""

import dataclasses
import json
import runpy
import sys

launcher, name, fields = sys.argv[1:4]
del sys.argv[1:4]
runpy.run_path(launcher, run_name="titan_cpu")  # its patches, without its __main__ block
from torchtitan.models.llama3 import llama3_args  # noqa: E402

llama3_args[name] = dataclasses.replace(llama3_args["debugmodel"], **json.loads(fields))
sys.argv[0] = "torchtitan.train"
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
