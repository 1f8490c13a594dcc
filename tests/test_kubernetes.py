"""The Kubernetes examples (examples/kubernetes/): a Kubeflow PyTorchJob and a JobSet, 1 PS and
2 workers, one psrpc rank per pod. Each manifest is rendered here as its engine would make the
pods: their names, the labels and annotations on them, the environment the engine adds to the
container's own (the training operator's MASTER_ADDR, RANK, ...; the Job controller's completion
index), fieldRef values, and $(VAR) expansion in env values and the command as the kubelet does
it. Those commands then run in emulated hosts (benchmarks/hosts.py: own network, host name,
/etc/hosts, PIDs, /dev/shm) named as the pods' DNS names, and every rank must end with 0 and the
chief write its outputs. What differs from a cluster, on purpose:
- the manifests say `cluster.interface=eth0` (a pod's interface); an emulated host's is eth1,
  so the rendered command says `cluster.interface=eth1`;
- the PVC is a folder of tmp_path that every emulated host sees (they share this machine's
  files): its mountPath is replaced by that folder in the rendered command and environment;
- `python` is this interpreter, and the suite's CPU overrides (tests/conftest.py `on_cpu`) follow
  the manifest's arguments.
The restart policies are read from the manifests (parsed, not grepped) and evaluated as each
engine does: 138 starts the rank again, 2 ends the job. Needs root; skips saying why otherwise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import pytest
import yaml

from benchmarks import hosts
from psrpc.errors import EXIT_RETRY, EXIT_USER
from tests.conftest import ROOT, on_cpu
from tests.test_hosts import _wait, nothing_left  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(hosts.missing() is not None, reason=str(hosts.missing()))]
EXAMPLES = ROOT / "examples" / "kubernetes"


def _load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


# -- what an engine makes of a manifest ----------------------------------------------------------
@dataclass
class Pod:
    name: str
    """Its host name."""
    dns: str
    """The name the other pods reach it by."""
    env: dict[str, str]
    command: list[str]
    """command + args, expanded."""
    mounts: dict[str, str]
    """mountPath -> the PersistentVolumeClaim mounted there."""


_REF = re.compile(r"\$(\$|\(([^)]*)\))")
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $(NAME) becomes NAME's value where `env` has it and stays
    as it is where not; $$ is one $ and what follows it is not expanded."""
    return _REF.sub(lambda m: "$" if m.group(1) == "$" else env.get(m.group(2), m.group(0)),
                    text)


def container_env(entries: list[dict], meta: dict) -> dict[str, str]:
    """A container's environment from its env list, in order: a value may refer to the ones
    before it; a fieldRef reads the pod's metadata."""
    env: dict[str, str] = {}
    for entry in entries:
        if "valueFrom" in entry:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            if path == "metadata.name":
                env[entry["name"]] = meta["name"]
                continue
            where = _FIELD.fullmatch(path)
            assert where, f"{entry['name']}: fieldPath {path!r} is not rendered here"
            env[entry["name"]] = meta[where.group(1)][where.group(2)]
        else:
            env[entry["name"]] = expand(str(entry.get("value", "")), env)
    return env


def _pod(host: str, dns: str, pod_spec: dict, container: dict, env_list: list[dict],
         meta: dict) -> Pod:
    env = container_env(env_list, meta)
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod_spec.get("volumes", []) if "persistentVolumeClaim" in v}
    return Pod(host, dns, env,
               [expand(x, env) for x in container.get("command", []) + container.get("args", [])],
               {m["mountPath"]: claims[m["name"]] for m in container.get("volumeMounts", [])
                if m["name"] in claims})


def pytorchjob_pods(job: dict) -> list[Pod]:
    """The pods Kubeflow's training operator (v1) makes: <job>-master-0 and <job>-worker-<i>,
    each behind a headless service of the same name, their container's env followed by what the
    operator appends (pkg/controller.v1/pytorch/envvar.go, setPodEnv: WORLD_SIZE is the replicas
    times nprocPerNode, RANK is the Master's 0 and Worker i's i + 1; master.go: MASTER_PORT is
    the Master container's port named pytorchjob-port, MASTER_ADDR <job>-master-0)."""
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    nproc = str(job["spec"].get("nprocPerNode", "auto"))
    replicas = sum(spec.get("replicas", 1) for spec in specs.values())
    world = replicas * (int(nproc) if nproc.isdigit() else 1)

    def container(rtype: str) -> dict:
        (c,) = [c for c in specs[rtype]["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        return c

    port = next((p["containerPort"] for p in container("Master").get("ports", [])
                 if p.get("name") == "pytorchjob-port"), 23456)  # (the operator's default)
    pods = []
    for rtype in ("Master", "Worker"):
        for i in range(specs[rtype].get("replicas", 1)):
            pod_name, rank = f"{name}-{rtype.lower()}-{i}", i + (rtype == "Worker")
            meta = {"name": pod_name, "annotations": {}, "labels": {
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/replica-type": rtype.lower(),
                "training.kubeflow.org/replica-index": str(i)}}
            added = [("PYTHONUNBUFFERED", "0"), ("MASTER_PORT", port),
                     ("MASTER_ADDR", f"{name}-master-0"), ("WORLD_SIZE", world), ("RANK", rank),
                     ("PET_NPROC_PER_NODE", nproc), ("PET_NODE_RANK", rank),
                     ("PET_NNODES", replicas)]
            c = container(rtype)
            pods.append(_pod(pod_name, pod_name, specs[rtype]["template"]["spec"], c,
                             c.get("env", []) + [{"name": k, "value": str(v)} for k, v in added],
                             meta))
    return pods


def jobset_pods(js: dict) -> list[Pod]:
    """The pods of a JobSet's indexed Jobs: host name <jobset>-<replicatedJob>-<job index>-<pod
    index>, reachable as that.<subdomain> (network.subdomain, else the JobSet's name), with
    JobSet's labels and annotations (jobset-name, replicatedjob-name, job-index) and the Job
    controller's completion index: its annotation, and JOB_COMPLETION_INDEX appended to the
    container's env."""
    name = js["metadata"]["name"]
    subdomain = (js["spec"].get("network") or {}).get("subdomain") or name
    pods = []
    for rjob in js["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert job.get("completionMode") == "Indexed", rjob["name"]
        pod_spec = job["template"]["spec"]
        (c,) = pod_spec["containers"]
        for j in range(rjob.get("replicas", 1)):
            for i in range(job.get("completions", 1)):
                host = f"{name}-{rjob['name']}-{j}-{i}"
                marks = {"jobset.sigs.k8s.io/jobset-name": name,
                         "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                         "jobset.sigs.k8s.io/job-index": str(j),
                         "batch.kubernetes.io/job-completion-index": str(i)}
                meta = {"name": f"{host}-x7k2q", "labels": marks, "annotations": marks}
                index = {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath":
                         "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
                pods.append(_pod(host, f"{host}.{subdomain}", pod_spec, c,
                                 c.get("env", []) + [index], meta))
    return pods


# -- what an engine does when a rank ends with a code -------------------------------------------
def kubeflow_restarts(code: int) -> list[bool]:
    """Whether the training operator starts a pod again that ended with `code` under
    restartPolicy: ExitCode, by each rule its releases have had (pkg/util/train/train_util.go,
    IsRetryableExitCode): earlier, 130, 137, 138 (SIGUSR1: "for user defined retryable
    errors") and 143 only; later, any code from 128."""
    return [code in (130, 137, 138, 143), code >= 128]


def job_action(job: dict, code: int) -> str:
    """A Job's podFailurePolicy for a pod whose container ended with `code`: the first rule
    whose onExitCodes match (Count where none does: counted against backoffLimit)."""
    (container,) = job["template"]["spec"]["containers"]
    for rule in (job.get("podFailurePolicy") or {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is None or codes.get("containerName", container["name"]) != container["name"]:
            continue
        if (code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
    return "Count"


def jobset_action(js: dict, rjob: str, reason: str) -> str:
    """A JobSet's failurePolicy for a Job of `rjob` that failed for `reason`: the first rule
    whose onJobFailureReasons (none: any) and targetReplicatedJobs (none: all) match, else
    RestartJobSet."""
    for rule in (js["spec"].get("failurePolicy") or {}).get("rules", []):
        if reason in (rule.get("onJobFailureReasons") or [reason]) and \
                rjob in (rule.get("targetReplicatedJobs") or [rjob]):
            return rule["action"]
    return "RestartJobSet"


def test_the_manifests_start_a_rank_again_on_138_and_end_the_job_on_2():
    """138 (psrpc's EXIT_RETRY: this rank lost the run, started again it rejoins) starts the
    pod again under both engines; 2 (EXIT_USER: a restart cannot help) ends the job, under
    JobSet without a whole-JobSet restart either."""
    specs = _load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    assert sorted(specs) == ["Master", "Worker"]
    assert {rtype: spec["restartPolicy"] for rtype, spec in specs.items()} == {
        "Master": "ExitCode", "Worker": "ExitCode"}
    assert all(kubeflow_restarts(EXIT_RETRY)) and not any(kubeflow_restarts(EXIT_USER))

    js = _load("jobset.yaml")
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
    for rjob in js["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        # podFailurePolicy needs pods that are not restarted in place (the Job makes new ones)
        assert job["template"]["spec"]["restartPolicy"] == "Never"
        # 138: a new pod for that index (same rank, same name), counted against backoffLimit
        assert job_action(job, EXIT_RETRY) == "Count" and job.get("backoffLimit", 6) >= 1
        # ... and past it, every pod again (resuming from the checkpoint), up to maxRestarts
        assert jobset_action(js, rjob["name"], "BackoffLimitExceeded") == "RestartJobSet"
        # 2: the Job fails at once, and the JobSet with it
        assert job_action(job, EXIT_USER) == "FailJob"
        assert jobset_action(js, rjob["name"], "PodFailurePolicy") == "FailJobSet"


# -- the pods, run -------------------------------------------------------------------------------
# what would name another launcher, job or interface in this process's environment
LAUNCH_ENV = re.compile(r"(SLURM_|TORCHELASTIC_|PET_|SUBMITIT_).*|(LOCAL_|GROUP_)?RANK|"
                        r"(LOCAL_|GROUP_)?WORLD_SIZE|MASTER_(ADDR|PORT)|(TP|GLOO)_SOCKET_IFNAME")


def _local(text: str, pod: Pod, pvc: Path) -> str:
    """`text` with each PVC's mountPath as the folder that stands for the claim here."""
    for path, claim in pod.mounts.items():
        text = re.sub(rf"(?:^|(?<==)){re.escape(path)}(?=/|$)", str(pvc / claim), text)
    return text


@pytest.mark.parametrize("manifest,render", [("pytorchjob.yaml", pytorchjob_pods),
                                             ("jobset.yaml", jobset_pods)])
def test_the_pods_a_manifest_describes_train_in_emulated_pods(nothing_left, tmp_path, manifest,
                                                             render):
    """The pods the engine would make from the manifest, each on an emulated host named as the
    pod: ranks 0, 1, 2 (ps0, worker0 the chief, worker1) find the store on rank 0's pod by its
    DNS name, train, and end with 0; the chief's outputs are on the shared volume (the PVC),
    and each rank ran in its own pod."""
    pods = render(_load(manifest))
    assert [p.env["RANK"] for p in pods] == ["0", "1", "2"]
    assert {(p.env["WORLD_SIZE"], p.env["MASTER_ADDR"]) for p in pods} == {("3", pods[0].dns)}
    pvc = tmp_path / "pvc"
    for claim in {c for p in pods for c in p.mounts.values()}:
        (pvc / claim).mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if not LAUNCH_ENV.fullmatch(k)}
    procs = []
    with hosts.Hosts(len(pods), names=[p.dns for p in pods]) as h:
        for k, pod in enumerate(pods):
            command = [_local(x, pod, pvc) for x in pod.command]
            assert command[:3] == ["python", "-m", "psrpc"], command
            assert "cluster.interface=eth0" in command, command
            command = [sys.executable, "-m", "psrpc", *on_cpu(
                "cluster.interface=eth1" if x == "cluster.interface=eth0" else x
                for x in command[3:])]
            workdir = tmp_path / pod.name  # the container's own files
            workdir.mkdir()
            with open(tmp_path / f"{pod.name}.err", "w") as err:
                procs.append(h.popen(k, command, cwd=workdir, stdout=subprocess.DEVNULL,
                                     stderr=err, env={**base, **{
                                         key: _local(v, pod, pvc) for key, v in pod.env.items()}}))
        codes = _wait(procs, 200)
    logs = "".join(f"--- {p.name}\n" + (tmp_path / f"{p.name}.err").read_text() for p in pods)
    assert codes == [0, 0, 0], (codes, logs[-6000:])

    chief = pods[1]
    given = dict(x.split("=", 1) for x in chief.command if "=" in x)
    out = Path(_local(given["out_dir"], chief, pvc))
    assert out.is_relative_to(pvc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == int(given["train.steps"]), summary
    assert (out / "model.pt").is_file()
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["ps0.log", "worker0.log",
                                                                "worker1.log"]
    assert any(Path(_local(given["checkpoint.dir"], chief, pvc)).iterdir())
    assert summary["host_traffic"]["hosts"] == {
        pods[0].name: ["ps0"], pods[1].name: ["worker0"], pods[2].name: ["worker1"]}
