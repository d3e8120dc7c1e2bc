"""Several hosts, proven on one machine: two processes joined by ``jax.distributed`` (gloo CPU collectives), two
CPU devices each, run one engine at TP 4 over the four devices, then a data axis across the processes (2 replicas
of a TP 2 engine, one per process: each runs its share of the prompts, the results are gathered in prompt order on
both). Each rank is a subprocess with a timeout (a missing coordinator aborts its peers). Both ranks compute the
same plans and give the same greedy outputs, in the host loop and the device loop and from the replicas, as a
one-device engine in this process; the TP 4 engine is adaptive, on a cost table profiled across the processes
(every rank plans from rank 0's timings)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from spec_decode import Engine, SamplingParams
from tests.engine_models import bigram_drafter, damped_target, random_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(num_attention_heads=16, num_key_value_heads=2, index_n_heads=2, head_dim=16, num_local_experts=8,
             num_experts_per_tok=2)
COMMON = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, implementation="reference",
              min_token_bucket=32, sampling=False, cost_table=None, device_loop_token_buckets=1)
LENS, NEW = [20, 15, 30, 13, 26], [12, 9, 16, 5, 14]

RANK = textwrap.dedent("""
    import json, os, sys
    rank, port = int(sys.argv[1]), sys.argv[2]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MINIMAX_JAX_COMPILATION_CACHE"] = "0"
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=rank)
    jax.config.update("jax_default_matmul_precision", "highest")
    from spec_decode import Engine, SamplingParams
    from tests.engine_models import bigram_drafter, damped_target, random_prompts
    from tests.test_multihost import COMMON, LENS, NEW, SHAPE
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    target = damped_target(damping=0.3, **SHAPE)
    # adaptive on a table profiled here: each process times its own runs, and all of them plan from rank 0's
    eng = Engine(target, bigram_drafter(target, block_size=4), num_speculative_tokens=3, verification="adaptive",
                 tensor_parallel_size=4, **{**COMMON, "cost_table": "profile"})
    eng.warmup()
    prompts = random_prompts(5, LENS, seed=3)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in NEW]
    out = {loop: [r.token_ids for r in eng.generate(prompts, sampling_params=params, loop=loop, progress=False)]
           for loop in ("host", "device")}
    out["table"] = eng.cost_table.to_dict()
    # a data axis across the processes: replica i on process i's two devices, its slice of the prompts
    from minimax_jax import sharding
    from spec_decode.replicas import ReplicatedEngine
    target = damped_target(damping=0.3, **SHAPE)
    rep = ReplicatedEngine(target, bigram_drafter(target, block_size=4), mesh=sharding.make_mesh(2, data_parallel_size=2),
                           num_speculative_tokens=3, verification="fixed", **{**COMMON, "device_loop": False})
    assert rep.replica_ids == [rank] and rep.owners == [0, 1] and len(rep.engines) == 1
    assert {d.process_index for d in rep.engines[0].mesh.devices.flat} == {rank}
    got = rep.generate(prompts, sampling_params=params, progress=False)
    assert len(got.stats["replicas"]) == 2
    out["replicas"] = [r.token_ids for r in got]
    print("RESULT " + json.dumps(out), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_one_device_outputs():
    target = damped_target(damping=0.3, **SHAPE)
    eng = Engine(target, bigram_drafter(target, block_size=4), num_speculative_tokens=3, verification="fixed",
                 device_loop=False, **COMMON)
    prompts = random_prompts(5, LENS, seed=3)
    want = [r.token_ids for r in eng.generate(prompts, sampling_params=[
        SamplingParams(max_new_tokens=m, ignore_eos=True) for m in NEW], progress=False)]

    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for r in (0, 1)]
    outs = []
    try:
        for p in ranks:
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, stderr[-4000:]
            outs.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:]))
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for out in outs:
        assert out["host"] == want and out["device"] == want and out["replicas"] == want
    assert outs[0]["table"] == outs[1]["table"]
    assert outs[0]["table"]["metadata"]["source"].startswith("engine warm-up profile") and outs[0]["table"]["per_length"]
