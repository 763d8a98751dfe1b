"""The cluster launch files, rendered for 4 nodes x 8 GPUs without a cluster: every process must get the same
coordinator (process 0's host), the process count, a distinct process id, and its share of the node's GPUs.

The SLURM script runs under bash with stand-ins for `scontrol` and `srun` (which starts one shell per task with
SLURM's per-task variables) and for `jaxpar` (which prints its arguments); the JobSet is rendered the way
`envsubst` would and parsed as YAML."""

import json
import os
import pathlib
import stat
import string
import subprocess
import sys

import pytest
import yaml

from jaxpar import distributed

ROOT = pathlib.Path(__file__).resolve().parent.parent
NODES, GPUS = 4, 8
HOSTS = [f"gpu{i:02d}" for i in range(1, NODES + 1)]

FAKE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args[0].startswith("--"):  # srun's own options
    args.pop(0)
n, per = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
for i in range(n):  # what srun sets in each task
    env = {{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per), "SLURM_NODEID": str(i // per),
           "SLURMD_NODENAME": "gpu%02d" % (i // per + 1)}}
    subprocess.run(args, env=env, check=True)
"""
FAKE_SCONTROL = "#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf '%s\\n' " + " ".join(HOSTS) + "\n"
FAKE_JAXPAR = """#!{python}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "node": os.environ["SLURMD_NODENAME"]}}))
"""


def write_exe(path: pathlib.Path, text: str) -> None:
    path.write_text(text.format(python=sys.executable) if "{python}" in text else text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("tasks_per_node", [1, GPUS])
def test_sbatch_wires_every_process(tmp_path, tasks_per_node):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "srun", FAKE_SRUN)
    write_exe(bin_dir / "scontrol", FAKE_SCONTROL)
    write_exe(bin_dir / "jaxpar", FAKE_JAXPAR)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "gpu[01-04]",
           "SLURM_NTASKS": str(NODES * tasks_per_node), "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
           "SLURM_GPUS_ON_NODE": str(GPUS)}
    run = subprocess.run(["bash", str(ROOT / "scripts/slurm/train.sbatch"), "--config", "configs/llama_1b.py",
                          "--config.parallel.tensor=8"], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr
    calls = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    n = NODES * tasks_per_node
    assert len(calls) == n
    per_task = GPUS // tasks_per_node
    for k, call in enumerate(calls):
        argv = call["argv"]
        assert argv[0] == "train" and argv[-3:] == ["--config", "configs/llama_1b.py", "--config.parallel.tensor=8"]
        assert flag(argv, "--coordinator") == f"gpu01:{20000 + 4321 % 20000}"  # the first node, every process
        assert flag(argv, "--num-processes") == str(n)
        assert flag(argv, "--process-id") == str(k)
        local = k % tasks_per_node
        assert flag(argv, "--local-device-ids") == ",".join(map(str, range(local * per_task, (local + 1) * per_task)))
        # and jaxpar reads them as intended
        s = distributed.resolve(flag(argv, "--coordinator"), n, k, flag(argv, "--local-device-ids"), env={})
        assert (s.num_processes, s.process_id, len(s.local_device_ids)) == (n, k, per_task)


def render_jobset(**values) -> dict:
    text = (ROOT / "scripts/k8s/jobset.yaml").read_text()
    rendered = string.Template(text).substitute(values)  # envsubst's ${VAR} syntax
    assert "${" not in rendered
    return yaml.safe_load(rendered)


@pytest.mark.parametrize("args", ['"--config.parallel.tensor=8"', ""])
def test_jobset_wires_every_process(args):
    doc = render_jobset(NAME="llama1b", NODES=NODES, GPUS_PER_NODE=GPUS, PORT=1234, IMAGE="jaxpar:test",
                        PVC="runs", CONFIG="configs/llama_1b.py", ARGS=args)
    assert doc["kind"] == "JobSet" and doc["spec"]["network"]["enableDNSHostnames"] is True
    (workers,) = doc["spec"]["replicatedJobs"]
    job = workers["template"]["spec"]
    assert (workers["name"], workers["replicas"]) == ("workers", 1)
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == NODES
    (container,) = job["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    # pod 0 of replicated job "workers" (job index 0) under the JobSet's headless service (subdomain = its name)
    assert env["JAXPAR_COORDINATOR"]["value"] == "llama1b-workers-0-0.llama1b:1234"
    assert container["ports"][0]["containerPort"] == 1234
    assert env["JAXPAR_NUM_PROCESSES"]["value"] == str(NODES)
    assert env["JAXPAR_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == GPUS
    assert container["command"][:4] == ["jaxpar", "train", "--config", "configs/llama_1b.py"]
    assert container["command"][4:] == ["--workdir", "/runs/llama1b", "--no-progress"] + ([args.strip('"')] if args
                                                                                         else [])
    # what pod 2 sees, read the way jaxpar reads it: one process per node, all its GPUs (no local-device limit)
    pod2 = {"JAXPAR_COORDINATOR": env["JAXPAR_COORDINATOR"]["value"], "JAXPAR_NUM_PROCESSES": str(NODES),
            "JAXPAR_PROCESS_ID": "2"}
    s = distributed.resolve(env=pod2)
    assert (s.coordinator, s.num_processes, s.process_id, s.local_device_ids) == (
        "llama1b-workers-0-0.llama1b:1234", NODES, 2, None)
