"""hydra/launcher=normlab: device slots, worker pinning, and concurrent jobs equal to sequential ones."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

import normlab.launch.launcher as launcher
from normlab.launch.launcher import plan_slots, threads_per_job
from normlab.launch.machine import visible_gpus
from cli_here import normlab_here
from test_cli import TINY, run_dirs
from wandb_log import finished_run_records


def test_slots_are_dealt_round_robin_over_the_gpus():
    assert plan_slots(["0", "1"], jobs_per_gpu=2, cpu_jobs=1) == ["0", "1", "0", "1"]
    assert plan_slots(["3"], jobs_per_gpu=3, cpu_jobs=1) == ["3", "3", "3"]
    assert plan_slots([], jobs_per_gpu=4, cpu_jobs=1) == [None]  # no GPU: one job at a time
    assert plan_slots([], jobs_per_gpu=4, cpu_jobs=2) == [None, None]
    with pytest.raises(ValueError):
        plan_slots(["0"], jobs_per_gpu=0, cpu_jobs=1)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert visible_gpus() == ["2", "5"]  # a worker pinned to "5" sees the physical GPU 5
    assert visible_gpus([0, 1]) == ["0", "1"]  # hydra.launcher.devices wins
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpus() == []


def test_the_devices_a_sweep_names_must_be_this_machines(monkeypatch):
    from normlab.config import ConfigError
    from normlab.launch import machine

    settings = {"jobs_per_gpu": 4, "cpu_jobs": 1, "mps": "auto"}
    monkeypatch.setattr(machine, "_gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine.check_launcher({**settings, "devices": [0, 1]})
    machine.check_launcher({**settings, "devices": None})
    with pytest.raises(ConfigError, match=r"devices=\[1,2\]: this machine has 2 GPUs \(ids 0 to 1\), no GPU 2"):
        machine.check_launcher({**settings, "devices": [1, 2]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # ids it hides may be meant: CUDA says when a worker starts
    machine.check_launcher({**settings, "devices": [4]})
    monkeypatch.setattr(machine, "_gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="this machine has no GPU torch can use"):
        machine.check_launcher({**settings, "devices": [0]})


def test_no_gpu_is_known_without_torch_only_where_none_can_be(monkeypatch, tmp_path):
    """A Linux machine without a GPU's device files or an NVIDIA GPU on its PCI bus, or macOS, has no CUDA device for
    torch; anywhere else, or once torch is imported, torch is asked."""
    import normlab.launch.machine as machine

    (tmp_path / "pci").mkdir()
    monkeypatch.setattr(machine, "PCI_DEVICES", str(tmp_path / "pci"))  # a PCI bus without devices
    monkeypatch.delitem(sys.modules, "torch")  # the module object stays alive in the test's imports
    present: set = set()
    monkeypatch.setattr(machine.os.path, "exists", lambda path: path in present)
    monkeypatch.setattr(machine.sys, "platform", "linux")
    assert machine.gpu_impossible()
    for path in machine.GPU_DEVICE_FILES:  # NVIDIA, WSL, ROCm
        present.add(path)
        assert not machine.gpu_impossible()
        present.clear()
    monkeypatch.setattr(machine.sys, "platform", "darwin")
    assert machine.gpu_impossible()
    monkeypatch.setattr(machine.sys, "platform", "win32")
    assert not machine.gpu_impossible()
    monkeypatch.setattr(machine.sys, "platform", "linux")
    monkeypatch.setitem(sys.modules, "torch", object())
    assert not machine.gpu_impossible()


def test_a_gpu_whose_device_files_are_not_made_yet_is_left_to_torch(monkeypatch, tmp_path):
    """NVIDIA's device files exist once udev, or the nvidia-modprobe that libcuda runs at its first use, makes them:
    before that an NVIDIA GPU shows on the PCI bus (sysfs), and torch's look makes them and finds it. A Jetson's GPU
    has nvgpu's files instead. Where sysfs cannot be read, torch is asked."""
    import normlab.launch.machine as machine

    pci = tmp_path / "pci"
    for name, vendor, pci_class in (("0000:00:00.0", "0x8086", "0x060000"),  # a host bridge
                                    ("0000:01:00.1", "0x10de", "0x040300")):  # an NVIDIA GPU's audio function
        (pci / name).mkdir(parents=True)
        (pci / name / "vendor").write_text(vendor + "\n")
        (pci / name / "class").write_text(pci_class + "\n")
    monkeypatch.setattr(machine, "PCI_DEVICES", str(pci))
    monkeypatch.delitem(sys.modules, "torch")  # the module object stays alive in the test's imports
    present: set = set()
    monkeypatch.setattr(machine.os.path, "exists", lambda path: path in present)
    monkeypatch.setattr(machine.sys, "platform", "linux")
    assert machine.gpu_impossible()
    for path in ("/dev/nvhost-ctrl-gpu", "/dev/nvgpu"):  # a Jetson's GPU: nvgpu's control file, older and newer name
        present.add(path)
        assert not machine.gpu_impossible()
        present.clear()
    (pci / "0000:01:00.0").mkdir()
    (pci / "0000:01:00.0" / "vendor").write_text("0x10de\n")
    (pci / "0000:01:00.0" / "class").write_text("0x030200\n")  # a 3D controller: a data-centre GPU
    assert not machine.gpu_impossible()
    monkeypatch.setattr(machine, "PCI_DEVICES", str(tmp_path / "no-sysfs"))
    assert not machine.gpu_impossible()


@pytest.mark.parametrize("pack", [[], ["pack=true"]], ids=["plain", "packed"])
def test_a_cpu_sweeps_launching_process_leaves_torch_to_its_workers(tmp_path, pack):
    """On a machine without a GPU, the checks before Hydra starts (a pack's too), the launcher's slots and the ranks'
    check import no torch: the workers' forkserver imports it while the launching process composes the sweep."""
    code = (
        "import sys\n"
        "import normlab.launch.app as app\n"
        "from normlab.launch.machine import gpu_impossible, visible_gpus\n"
        "from normlab.launch.prechecks import check_command\n"
        "from normlab.launch.resolvers import register_resolvers\n"
        "from normlab.train.ranks import several_ranks\n"
        "register_resolvers()\n"
        "if not gpu_impossible(): print('gpu'); sys.exit()\n"
        f"overrides = ['seed=0,1', 'model=tiny', *{pack!r}, 'hydra.sweep.dir={tmp_path}/sweep']\n"
        "check_command(overrides, [], True, None)\n"
        "app._hydra_main = lambda command_line: None  # the sweep itself: its jobs import torch\n"
        "app._train(['-m', *overrides], overrides, [], True, None)  # the ranks' check, Hydra's launcher registered\n"
        "print(visible_gpus(), several_ranks(), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "SUBMITIT_EXECUTOR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    if out.strip() == "gpu":
        pytest.skip("a machine that may have a GPU (its device files, or one on the PCI bus): the launcher asks torch")
    assert out.strip() == "[] False False"


def test_threads_are_shared_out(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert threads_per_job(4) == 2 and threads_per_job(16) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_job(4) == 4


def _seen():
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ["OMP_NUM_THREADS"]


def test_a_worker_is_pinned_to_its_gpu_before_it_runs_a_job():
    # Two slots over a simulated split of two GPUs, as the launcher starts them (spawned, pinned at start).
    # The worker's start-up function as the module holds it now: Hydra's plugin scan may have re-run the module.
    seen = []
    for gpu in plan_slots(["0", "1"], jobs_per_gpu=1, cpu_jobs=1):
        with ProcessPoolExecutor(1, get_context("spawn"), initializer=launcher._pin_worker, initargs=(gpu, 3, 0.95)) as pool:
            seen.append(pool.submit(_seen).result())
    assert seen == [("0", "3"), ("1", "3")]


def _losses(root):
    out = {}
    for d in run_dirs(root):
        summary = json.loads((d / "summary.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").open()]
        losses = [(r["step"], r["loss"], r.get("val_loss")) for r in rows if "loss" in r]
        assert [step for step, _, _ in losses][:3] == [0, 1, 2]
        out[d.name] = (summary["status"], summary["final_val_loss"], losses)
    return out


def test_two_jobs_at_once_on_the_cpu_equal_the_sequential_sweep(tmp_path):
    sweep = ["train", "-m", "norm=layer,rms", *TINY, "max_steps=3", "log_every=1"]
    # Both through normlab.cli.main in this process: the concurrent jobs run in the launcher's worker processes.
    # The reference needs no wandb run (about two seconds a job); the concurrent jobs keep theirs.
    sequential = normlab_here(*sweep, "hydra.sweep.dir=seq", "wandb.mode=disabled", cwd=tmp_path)
    assert sequential.returncode == 0, sequential.stderr[-3000:]
    # CUDA_VISIBLE_DEVICES="": the CPU's slots (cpu_jobs), also on a machine with a GPU.
    concurrent = normlab_here(*sweep, "hydra.sweep.dir=conc", "hydra.launcher.cpu_jobs=2", cwd=tmp_path,
                              env={"CUDA_VISIBLE_DEVICES": ""})
    assert concurrent.returncode == 0, concurrent.stderr[-3000:]
    assert "2 at once on the CPU" in concurrent.stdout + concurrent.stderr
    seq, conc = _losses(tmp_path / "seq"), _losses(tmp_path / "conc")
    assert len(seq) == 2 and seq == conc  # same dirs, statuses, final losses and loss curves, bit for bit
    assert all(status == "completed" for status, _, _ in seq.values())
    for name in seq:
        assert f"job {name.split('_')[0]} {name.split('_', 1)[1]}: completed" in concurrent.stdout
    for name in conc:  # each job's end ran in its worker's end thread, done before the command returned
        summary = json.loads((tmp_path / "conc" / name / "summary.json").read_text())
        assert {"products", "sinks"} <= set(summary["phases"])
        [wandb_file] = (tmp_path / "conc" / name).glob("wandb/offline-run-*/run-*.wandb")
        assert "exit" in [r.WhichOneof("record_type") for r in finished_run_records(wandb_file)]


def test_composed_once_hands_the_validated_config_to_the_launch_once_and_keeps_nothing_after():
    from omegaconf import OmegaConf

    from normlab.launch.composed import ComposedOnce

    composed = []

    def load(master, overrides):
        composed.append(list(overrides))
        return OmegaConf.create({"job": list(overrides), "hydra": {"job": {"num": None}}})

    master = OmegaConf.create({})
    once = ComposedOnce(load)
    validated = [once(master, [f"seed={s}"]) for s in range(3)]  # the sweeper validates the batch
    with once.launch():
        first = once(master, ["seed=0"])  # the launcher: the validation's config, a copy of its own
        assert len(composed) == 3 and first == validated[0] and first is not validated[0]
        first.hydra.job.num = 0
        again = once(master, ["seed=0"])  # a pack's later pass composes afresh, and nothing is kept
        assert len(composed) == 4 and again.hydra.job.num is None and once.kept.keys() == {
            (id(master), ("seed=1",)), (id(master), ("seed=2",))}
    assert once.kept == {}  # what the launch did not take is forgotten
    once(master, ["seed=1"])
    with once.launch():
        once(master, ["seed=1"])
    assert len(composed) == 5  # the next batch: validated, then taken


class _Loader:
    def load_sweep_config(self, master, overrides):
        return list(overrides)


def test_composed_once_travels_to_a_worker_as_the_workers_own_which_keeps_nothing():
    import pickle

    from normlab.launch.composed import ComposedOnce

    loader = _Loader()
    loader.load_sweep_config = ComposedOnce(loader.load_sweep_config)
    loader.load_sweep_config({}, ["seed=0"])  # kept here, for this process's launch
    sent = pickle.loads(pickle.dumps(loader))
    worker = sent.load_sweep_config
    assert isinstance(worker, ComposedOnce) and worker is not loader.load_sweep_config and worker.kept == {}
    assert worker({}, ["seed=1"]) == ["seed=1"] and worker.kept == {}  # the worker composes its jobs itself
    assert len(loader.load_sweep_config.kept) == 1
    assert pickle.loads(pickle.dumps(loader)).load_sweep_config is worker  # the next unit: the same one, its Composer
    other = ComposedOnce(_Loader().load_sweep_config)
    both = pickle.loads(pickle.dumps((loader, other)))  # another loader's (a unit brings two): one of its own
    assert both[0].load_sweep_config is worker and both[1] is not worker
    assert pickle.loads(pickle.dumps(loader)).load_sweep_config is worker  # and this one's is still kept


def test_a_workers_later_jobs_are_derived_and_equal_hydras_sweep_configs():
    """A worker (here, this process unpickling what a worker gets) composes the first job of a shape whole and
    derives the next ones from it; each equals Hydra's own load_sweep_config."""
    import pickle

    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from normlab.launch.composed import ComposedOnce
    from normlab.launch.prechecks import _main_hydra
    from normlab.launch.resolvers import register_resolvers

    register_resolvers()
    loader = _main_hydra([]).config_loader
    try:
        master = loader.load_configuration("config", ["hydra.sweep.dir=sweeps/x", "model=tiny"],
                                           run_mode=RunMode.MULTIRUN, from_shell=True)
        hydras_load = loader.load_sweep_config
        loader.load_sweep_config = ComposedOnce(hydras_load)
        for seed in range(3):
            job = [f"seed={seed}", "lr=1e-3", "progress=false"]
            worker = pickle.loads(pickle.dumps(loader)).load_sweep_config  # each unit brings the loader anew
            ours, hydras = worker(master, job), hydras_load(master, job)
            assert OmegaConf.to_container(ours, resolve=False) == OmegaConf.to_container(hydras, resolve=False), job
        assert worker.composer.whole == 1  # the first job; the other two were derived
    finally:
        GlobalHydra.instance().clear()


def test_workers_start_pinned_and_only_the_slots_used_stay():
    from normlab.launch.workers import Workers

    workers = Workers(["0", "1", "0"], threads=2, fraction=0.3, warm=False)
    try:
        workers.keep(2)  # a sweep of two units: the third worker goes
        assert len(workers) == 2 and workers.slots == ["0", "1"]
        assert [workers[slot].submit(_seen).result() for slot in range(2)] == [("0", "2"), ("1", "2")]
    finally:
        workers.shutdown()


def _preemptible(ready: str) -> str:
    """A job that takes SIGTERM as a preemption, as a training job does: it says it is ready, then runs until one."""
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    Path(ready).touch()
    while not stopped:
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return "preempted"


def test_terminate_sends_sigterm_to_the_workers_running_a_unit_only(tmp_path):
    """What the launcher does when SIGTERM unwinds it (`kill PID` reaches it alone): its running jobs preempt."""
    from normlab.launch.workers import Workers

    workers = Workers(["0", "1"], threads=1, fraction=0.5, warm=False)
    try:
        idle = workers[1].submit(os.getpid).result(timeout=60)
        job = workers[0].submit(_preemptible, str(tmp_path / "ready"))
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and not job.done(), "the job did not start"
            time.sleep(0.02)
        workers.terminate(set())
        time.sleep(0.3)
        assert not job.done()
        workers.terminate({0})
        assert job.result(timeout=30) == "preempted"
        assert workers[1].submit(os.getpid).result(timeout=30) == idle  # the idle worker was left alone
    finally:
        workers.shutdown()


PARENT = """
import os, signal, sys
from normlab.launch.workers import Workers
workers = Workers([None], threads=1, fraction=1.0, warm=False)
print(workers[0].submit(os.getpid).result(timeout=60), flush=True)
os.kill(os.getpid(), signal.SIGKILL if sys.argv[1] == "kill" else signal.SIGTERM)
"""


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_worker_ends_when_its_launching_process_is_killed(how):
    """A launching process killed before it ends its workers (its SIGTERM runs no clean-up) left them waiting
    for jobs for ever, re-parented: each worker now ends with its parent."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE, text=True)
    _parent_dies_then_its_worker(proc, -signal.SIGKILL if how == "kill" else -signal.SIGTERM)


BUSY_JOB = """
import signal, time
def job():  # takes SIGTERM as a preemption, as a training job does, and returns
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    while not stopped:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return "preempted"
"""

BUSY_PARENT = """
import os, signal, sys, time
from normlab.launch.workers import Workers, in_unit
import busy_job
workers = Workers([None], threads=1, fraction=1.0, warm=False)
print(workers[0].submit(os.getpid).result(timeout=60), flush=True)
workers[0].submit(in_unit, busy_job.job)
time.sleep(1)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_whose_job_took_its_parents_end_as_a_preemption_ends_after_it(tmp_path):
    """The job running when the launching process died takes end_with_parent's SIGTERM as a preemption and returns:
    its worker then ends too, where it waited for jobs for ever (with its forkserver)."""
    (tmp_path / "busy_job.py").write_text(BUSY_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", BUSY_PARENT], stdout=subprocess.PIPE, text=True, env=env)
    _parent_dies_then_its_worker(proc, -signal.SIGKILL)


def _parent_dies_then_its_worker(proc: subprocess.Popen, returncode: int) -> None:
    """`proc` prints its worker's pid, then dies with `returncode`: its worker must end within 30 s."""
    worker = int(proc.stdout.readline())  # not read to its end: a surviving worker would hold the pipe open
    try:
        assert proc.wait(timeout=60) == returncode
        deadline = time.monotonic() + 30
        while _running(worker):
            assert time.monotonic() < deadline, f"worker {worker} still running 30 s after its parent died"
            time.sleep(0.05)
    finally:
        if _running(worker):
            os.kill(worker, signal.SIGKILL)
        proc.stdout.close()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_worker_takes_the_launchs_hydra_singletons_but_keeps_its_plugins_and_resolvers():
    """Each unit brings the launching process's Hydra singletons; the worker's plugins, found at its first unit, are
    not scanned for again (Singleton.set_state alone would), and its resolvers stay its own."""
    import pickle

    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton
    from omegaconf.basecontainer import BaseContainer

    from normlab.launch import launcher

    Plugins.instance()
    saved = Singleton.get_state()
    plugins, resolvers = Singleton._instances[Plugins], dict(BaseContainer._resolvers)
    sent = pickle.loads(pickle.dumps({k: v for k, v in saved.items() if k != "omegaconf_resolvers"}))
    assert Plugins not in sent["instances"]  # Hydra's get_state leaves them out
    try:
        launcher._set_singletons(sent)
        assert Singleton._instances[Plugins] is plugins
        assert all(Singleton._instances[k] is v for k, v in sent["instances"].items())  # the launch's own
        assert BaseContainer._resolvers.keys() == resolvers.keys()
    finally:
        # With this process's Plugins: without them set_state scans for plugins again, which runs their modules
        # again, and Hydra's SourcesRegistry keeps the config sources' earlier classes; a later launch in this
        # process then cannot pickle its config loader for a worker ("not the same object").
        Singleton.set_state({**saved, "instances": {**saved["instances"], Plugins: plugins}})


def test_a_jobs_task_dict_is_its_config_without_the_hydra_node_resolved():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from normlab.launch.resolvers import register_resolvers, task_dict

    register_resolvers()
    with initialize_config_module(config_module="normlab.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["norm=rms", "model=tiny", "lr=1e-2", "wandb.group=${lr}"],
                      return_hydra_config=True)
    whole = OmegaConf.to_container(cfg, resolve=False)
    raw = task_dict(cfg)
    assert set(raw) == set(whole) - {"hydra"} and raw["norm"]["name"] == "rms" and raw["lr"] == 1e-2
    masked = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True)
    assert raw == masked and raw["wandb"]["group"] == 1e-2  # resolved, as the copy it replaces was
    assert OmegaConf.to_container(cfg, resolve=False) == whole  # the config itself is left as it was


@pytest.mark.parametrize("task", [
    {"seed": "${hydra.job.num}"},  # the hydra node is no part of the job's config: Hydra runs the job without it
    {"wandb": {"group": "${hydra.job.num}"}},
    {"wandb": {"group": "${oc.select:hydra.job.num,none}"}},
    {"seed": "???", "wandb": {"group": "???"}},  # a missing value, as to_container gives it
    {"seed": "???", "lr": "${seed}"},
    {"seed": None, "lr": "${seed}", "wandb": {"group": "${lr}"}},
], ids=["top", "nested", "select", "missing", "to-missing", "none"])
def test_a_jobs_task_dict_reads_what_its_copy_without_the_hydra_node_reads(task):
    from omegaconf import OmegaConf

    from normlab.launch.resolvers import task_dict

    cfg = OmegaConf.create({"hydra": {"job": {"num": 3}}, **task})
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg.hydra, True)  # as Hydra composes it

    def read(how):
        try:
            return how()
        except Exception as err:
            return type(err)

    copy = read(lambda: OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True))
    assert read(lambda: task_dict(cfg)) == copy
    assert OmegaConf.to_container(cfg, resolve=False) == {"hydra": {"job": {"num": 3}}, **task}
