"""dcgm-compat series carry dcgm-exporter's ``pod``, ``namespace`` and ``container`` for a GPU whose
compute process runs in a Kubernetes pod (issue 41: the hook was never wired): the real agent over
FakeNvml, the process's cgroup naming the pod uid and container id, the container runtime's bundle
naming the pod, rendered by the real exporter. The lookalikes carry none: a bundle of another pod,
a Slurm job's process, a GPU with no process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.proc_table import POD_V2, SLURM_V2
from tests.agent.test_agent_integration import START, FakeClock
from vigil.agent.config import parse_config
from vigil.agent.daemon import Agent
from vigil.agent.nvml.backend import PynvmlBackend
from vigil.agent.nvml.fake import FakeNvml
from vigil.agent.nvml.scenario import load_node_scenario
from vigil.agent.pod_names import BundlePodNames
from vigil.agent.runner import collect_once
from vigil.contract.seams import Seams

POD_UID = "3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
OTHER_UID = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
CONTAINER_ID = "c" * 64  # tests.agent.proc_table.POD_V2's container
FORGED_ID = "d" * 64


def _cgroup(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(text)


def _bundle(root: Path, container_id: str, uid: str, pod: str, *, crio: bool = False) -> None:
    annotations = ({"io.kubernetes.pod.uid": uid, "io.kubernetes.pod.namespace": "ml",
                    "io.kubernetes.pod.name": pod, "io.kubernetes.container.name": "trainer"} if crio else
                   {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-uid": uid,
                    "io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": pod,
                    "io.kubernetes.cri.container-name": "trainer"})
    path = root / container_id / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"ociVersion": "1.1.0", "annotations": annotations}))


def test_dcgm_compat_series_carry_the_pod_of_the_gpus_process(tmp_path: Path) -> None:
    proc, bundles = tmp_path / "proc", tmp_path / "k8s.io"
    _cgroup(proc, 1001, POD_V2.format(uid_=POD_UID.replace("-", "_")))  # GPU 0: a pod's trainer
    _bundle(bundles, CONTAINER_ID, POD_UID, "llama-0")
    # GPU 1: a process in the same pod whose container's bundle says another pod
    _cgroup(proc, 1002, POD_V2.format(uid_=POD_UID.replace("-", "_")).replace(CONTAINER_ID, FORGED_ID))
    _bundle(bundles, FORGED_ID, OTHER_UID, "someone-else")
    _cgroup(proc, 1003, SLURM_V2.format(job=4242))  # GPU 2: a Slurm job's process
    kmsg = tmp_path / "kmsg.log"
    kmsg.touch()
    clock = FakeClock(START)
    config = parse_config({
        "node": "gpu-node-17", "nvml": {"backend": "fake", "scenario": "healthy-h100"},
        "exporter": {"dcgm_compat": True},
        "collectors": {"gpu": {"xid_events": False, "proc_root": str(proc),
                               "pod_name_bundles": [str(bundles / "{id}" / "config.json")]}},
    })
    fake = FakeNvml(load_node_scenario("healthy-h100"), clock, start=START)
    fake.running_pids = {0: [1001], 1: [1002], 2: [1003]}
    backend = PynvmlBackend(fake)
    backend.init()
    agent = Agent(config, Seams(nvml=backend, clock=clock, kmsg=str(kmsg), sysfs_root=tmp_path / "no-sysfs",
                                state_dir=tmp_path))
    try:
        for c in agent.collectors:
            agent.snapshot.put(c.name, collect_once(c, clock.t))
        text = agent.render_metrics().decode()
    finally:
        for c in agent.collectors:
            c.close()
    temps = {s.labels["gpu"]: s.labels for f in text_string_to_metric_families(text)
             if f.name == "DCGM_FI_DEV_GPU_TEMP" for s in f.samples}
    assert len(temps) == 8
    assert {k: temps["0"][k] for k in ("pod", "namespace", "container")} == \
        {"pod": "llama-0", "namespace": "ml", "container": "trainer"}
    for gpu in ("1", "2", "3"):
        assert not {"pod", "namespace", "container"} & temps[gpu].keys(), gpu
    # every dcgm-compat family of GPU 0 carries them, as dcgm-exporter's do
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith("DCGM_")]
    assert families and all(s.labels.get("pod") == "llama-0" for f in families for s in f.samples
                            if s.labels.get("gpu") == "0" and "UUID" in s.labels)


@pytest.mark.parametrize("crio", [False, True])
def test_bundle_names_are_answered_only_for_the_cgroups_pod(tmp_path: Path, crio: bool) -> None:
    _bundle(tmp_path, CONTAINER_ID, POD_UID, "llama-0", crio=crio)
    names = BundlePodNames([str(tmp_path / "{id}" / "config.json")])
    found = names(POD_UID, CONTAINER_ID)
    assert found is not None and (found.namespace, found.pod, found.container) == ("ml", "llama-0", "trainer")
    assert names(POD_UID, CONTAINER_ID) == found  # from the cache
    assert names(OTHER_UID, CONTAINER_ID) is None  # the bundle is another pod's, cached or not


def test_bundle_lookalikes_name_nothing(tmp_path: Path) -> None:
    names = BundlePodNames([str(tmp_path / "{id}" / "config.json")])
    _bundle(tmp_path, FORGED_ID, OTHER_UID, "someone-else")
    assert names(POD_UID, FORGED_ID) is None  # another pod's container
    assert names(POD_UID, None) is None and names(POD_UID, "../" + "c" * 61) is None  # no id, a path
    assert names(POD_UID, "e" * 64) is None  # no bundle
    bad = tmp_path / ("f" * 64)
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"annotations": {
        "io.kubernetes.cri.sandbox-uid": POD_UID, "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.sandbox-name": "Evil\nName", "io.kubernetes.cri.container-name": "trainer"}}))
    assert names(POD_UID, "f" * 64) is None  # not a Kubernetes name: never a label value
