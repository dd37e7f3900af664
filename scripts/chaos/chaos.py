#!/usr/bin/env python3
"""Chaos harness for `rtx launch` (issue 19): hurts a running elastic job in every way the
runtime claims to survive, then checks that it did.

Each run of the matrix (transport x policy x sharding x seed; transports quic, shm, and tls: the
control plane on QUIC and the collective frames on TLS over TCP, where the garbage action also
opens junk TCP connections at the workers' listeners) starts `rtx launch --nproc N` on
the elastic test config and, following a seeded plan, does: K `kill -9` of random workers, SIGSTOP
of a worker for S seconds then SIGCONT, a flood of garbage UDP datagrams at the supervisor's
control port and at every UDP port the workers hold, and `rtx status` / `rtx worker --join` with a
wrong token. An undisturbed run of the same config (per sharding) gives the reference accuracy.

The plan is a pure function of the seed and the flags (printed before every run): each action
fires `gap` committed steps after the previous disturbance has recovered (the recovery
generation has committed a step; with `replace`, the group is back to N workers), plus a random
delay of a few ms so the signal lands at a random point inside a step; its target is a slot in
the rank order of the generation then running.

Per run it measures and checks (from `events.jsonl`, `cluster.json`, `/proc`):
  - per kill: kill -> `lost` event (detection) and kill -> first committed step of the recovery
    generation (recovery); steps re-run (last committed step before the recovery generation + 1
    minus its `next_step`);
  - regressions: a generation whose `next_step` lies below the newest durable state (the newest
    checkpoint + 1; the last committed step + 1 when a survivor of the previous generation is in
    it, replicated; under ZeRO-1 the last restorable snapshot: a multiple of snapshot_every, a
    checkpoint, or the previous generation's start);
  - losses nobody caused (a worker lost that was neither killed nor stopped), and recoveries
    slower than --stall-limit (a hang, on any machine);
  - the job finished (launcher exit 0, `finished` event), replicas bit-identical, test accuracy
    within a tolerance of the undisturbed run;
  - no orphans: no process of the run alive once the launcher has exited (every pid it ever had,
    and any process whose command line or RTX_RUN_DIR names the run's folder), and no
    shared-memory ring file of the run left behind;
  - wrong tokens refused: `rtx status` and `rtx worker --join` exit non-zero saying "wrong
    cluster token", the worker's attempt is a `refused` event, and the right token still works.

Meshes: `--config configs/sotu_gpt_3d.toml --workers 8 --policies replace --sharding replicated
--metric none` hurts a (dp, pp, tp) = (2, 2, 2) job the same way (a victim is a mesh member at a
random coordinate); no member holds the whole model to evaluate, so instead of an accuracy each
run reports whether it ended with the undisturbed run's parameter bits. `--sharding zero2` runs
ZeRO-2 (same snapshot rule as ZeRO-1).

It prints a line per action and per run, a table per transport and sharding, PASS/FAIL per bar,
and writes a JSON summary. Exit status 1 names the failed checks (2: bad usage).
Only the Python standard library is needed (the GPU hosts have no Rust toolchain).
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Presets: defaults for every flag that is not given. `short` is what CI runs (tests/chaos.rs);
# `long` is the acceptance run with the bars enforced; `sample` is a small version of `long`.
PRESETS = {
    "short": dict(workers=3, kills=2, stops=1, stop_seconds=1.6, garbage=20000, seeds="7", transports="quic,shm,tls", policies="shrink,replace",
                  sharding="replicated,zero1", matrix="pairwise", steps=1600, checkpoint_every=200, acc_tol=0.05, run_timeout=90.0, enforce_bars=False),
    "long": dict(workers=8, kills=7, stops=1, stop_seconds=2.0, garbage=20000, seeds="1,2,3", transports="quic,shm", policies="shrink,replace",
                 sharding="replicated,zero1", matrix="full", steps=6000, checkpoint_every=500, acc_tol=0.03, run_timeout=600.0, enforce_bars=True),
    "sample": dict(workers=4, kills=6, stops=1, stop_seconds=2.0, garbage=20000, seeds="1", transports="quic,shm", policies="shrink,replace",
                   sharding="replicated,zero1", matrix="full", steps=2500, checkpoint_every=500, acc_tol=0.03, run_timeout=300.0, enforce_bars=True),
}

# Junk TCP connections per worker listener in a garbage action over the TLS transport.
GARBAGE_CONNECTIONS_PER_PORT = 40

# Bars of the long variant (issue 19).
BAR_WORKERS = 8
BAR_KILLS_PER_TRANSPORT = 20
BAR_SEEDS_PER_TRANSPORT = 3
BAR_RECOVERY_MEDIAN_S = 1.0
BAR_RECOVERY_MAX_S = 2.0
BAR_ZERO1_RERUN_MAX = 1


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------- plan


def make_plan(seed, workers, kills, stops, garbage, wrong_token, policy, steps):
    """The seeded list of actions of one run (same arguments: same plan)."""
    rng = random.Random(f"chaos:{seed}")
    notes = []
    if policy == "shrink":
        # Every kill (and every stop, which the heartbeat timeout turns into an eviction) takes
        # one worker for good; keep at least one.
        room = max(0, workers - 1)
        stops_n = min(stops, room)
        kills_n = min(kills, room - stops_n)
        if (kills_n, stops_n) != (kills, stops):
            notes.append(f"shrink with {workers} workers leaves room for {room} losses: {kills_n} kill(s), {stops_n} stop(s)")
    else:
        kills_n, stops_n = kills, stops
    kinds = ["kill"] * kills_n + ["stop"] * stops_n
    extras = (["garbage"] if garbage > 0 else []) + (["wrong_token"] if wrong_token else [])
    rng.shuffle(kinds)
    # Non-disruptive actions go at seeded positions among the disruptive ones.
    for e in extras:
        kinds.insert(rng.randrange(len(kinds) + 1), e)
    n = max(1, len(kinds))
    # Spread over about 60 % of the steps; gaps are counted from the last recovery, so they are
    # an upper bound on where the action lands.
    hi = max(4, int(0.6 * steps / (n + 1)))
    lo = max(2, hi // 3)
    first = max(10, int(0.05 * steps))
    actions = []
    for i, kind in enumerate(kinds):
        gap = rng.randint(lo, hi) + (first if i == 0 else 0)
        actions.append({"i": i, "kind": kind, "gap": gap, "jitter_ms": rng.randint(0, 40), "slot": rng.randrange(1 << 30)})
    return actions, notes


# ----------------------------------------------------------------------------- config


def make_config(base_text, steps, overrides):
    """The base config with `train.steps` and keys of `[elastic]` replaced."""
    text, n = re.subn(r"(?m)^steps\s*=\s*\d+\s*$", f"steps = {steps}", base_text, count=1)
    if n != 1:
        raise SystemExit("the config has no `steps = N` line in [train]")
    lines = text.splitlines()
    out, section, inserted = [], None, False
    for line in lines:
        m = re.match(r"^\s*\[([^\]]+)\]\s*$", line)
        if m:
            section = m.group(1).strip()
            out.append(line)
            if section == "elastic":
                out.extend(f"{k} = {toml_value(v)}" for k, v in overrides.items())
                inserted = True
            continue
        key = re.match(r"^\s*([A-Za-z0-9_]+)\s*=", line)
        if section == "elastic" and key and key.group(1) in overrides:
            continue
        out.append(line)
    if not inserted:
        out.append("")
        out.append("[elastic]")
        out.extend(f"{k} = {toml_value(v)}" for k, v in overrides.items())
    return "\n".join(out) + "\n"


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(str(v))


def elastic_setting(text, key, default):
    """The integer value of `key` in the config's [elastic] table, else `default`."""
    section = None
    for line in text.splitlines():
        m = re.match(r"^\s*\[([^\]]+)\]\s*$", line)
        if m:
            section = m.group(1).strip()
            continue
        m = re.match(rf"^\s*{key}\s*=\s*(\d+)", line)
        if section == "elastic" and m:
            return int(m.group(1))
    return default


# ----------------------------------------------------------------------------- processes


def proc_alive(pid):
    """True when `pid` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def own_ancestry():
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def processes_of_run(run_dir):
    """Pids whose command line holds `run_dir` or whose RTX_RUN_DIR is it (as `pgrep -f` would,
    plus the environment, which is where `rtx launch` tells its workers the folder)."""
    found, skip = set(), own_ancestry()
    needle = run_dir.encode()
    env_needle = b"RTX_RUN_DIR=" + needle + b"\0"
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            hit = needle in cmd
            if not hit:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    hit = env_needle in f.read() + b"\0"
        except (OSError, ProcessLookupError):
            continue
        if hit and proc_alive(pid):
            found.add(pid)
    return found


def udp_ports_of(pids):
    """UDP ports (ip, port) bound by the processes `pids`, read from /proc (no `ss` needed)."""
    return sockets_of(pids, ("/proc/net/udp", "/proc/net/udp6"), None)


def tcp_listeners_of(pids):
    """TCP ports (ip, port) the processes `pids` listen on (state 0A), read from /proc."""
    return sockets_of(pids, ("/proc/net/tcp", "/proc/net/tcp6"), "0A")


def sockets_of(pids, tables, state):
    """Local (ip, port) of the sockets in the /proc/net `tables` (rows in `state`, if given) whose
    inode one of `pids` holds open."""
    inodes = {}
    for path in tables:
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10:
                continue
            local, inode = cols[1], cols[9]
            if state is not None and cols[3] != state:
                continue
            ip_hex, port_hex = local.split(":")
            inodes[inode] = ("::1" if len(ip_hex) == 32 else "127.0.0.1", int(port_hex, 16))
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.match(r"socket:\[(\d+)\]", target)
            if m and m.group(1) in inodes:
                ports.add(inodes[m.group(1)])
    return sorted(ports)


def shm_jobs_of(pids):
    """Run ids of the shared-memory rings the processes map (`<dir>/rtx-<run>-g<gen>-<src>-<dst>.ring`;
    the files are unlinked once both ends have mapped them, so the maps say "(deleted)")."""
    jobs = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    m = re.search(r"(/\S+)/rtx-([0-9a-f]+)-g\d+-\d+-\d+\.ring", line)
                    if m:
                        jobs.add((m.group(1), m.group(2)))
        except OSError:
            continue
    return jobs


def shm_files_left(jobs):
    """Ring files of the run ids `jobs` still on disk (a ring a peer never came to map)."""
    left = []
    for d, run_id in sorted(jobs):
        try:
            left += [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith(f"rtx-{run_id}-")]
        except OSError:
            continue
    return left


def garbage_datagrams(rng, targets, count):
    """Sends `count` random datagrams of random sizes round-robin to `targets`; a quarter are
    shaped like QUIC Initial packets (long header, version 1, random connection ids, padded to
    1200 bytes) so they get past the first parsing step, an eighth like short-header packets."""
    sent, errors = 0, 0
    socks = {}
    for i in range(count):
        ip, port = targets[i % len(targets)]
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        s = socks.get(fam)
        if s is None:
            s = socks[fam] = socket.socket(fam, socket.SOCK_DGRAM)
        r = rng.random()
        if r < 0.25:
            dcid = rng.getrandbits(64).to_bytes(8, "big")
            body = bytes([0xC0 | rng.randrange(4)]) + b"\x00\x00\x00\x01" + b"\x08" + dcid + b"\x08" + rng.getrandbits(64).to_bytes(8, "big") + b"\x00"
            size = rng.randint(1200, 1400)
            body += rng.getrandbits(8 * (size - len(body))).to_bytes(size - len(body), "big")
        elif r < 0.375:
            size = rng.randint(21, 1400)
            body = bytes([0x40 | rng.randrange(64)]) + rng.getrandbits(8 * (size - 1)).to_bytes(size - 1, "big")
        else:
            size = rng.randint(0, 1472)
            body = rng.getrandbits(8 * size).to_bytes(size, "big") if size else b""
        try:
            s.sendto(body, (ip, port))
            sent += 1
        except OSError:
            errors += 1
    for s in socks.values():
        s.close()
    return sent, errors


def garbage_connections(rng, targets, count):
    """Opens `count` TCP connections round-robin to `targets` and sends each a random payload
    before closing it: half start like a TLS record (a handshake header with a random length),
    the rest are random bytes, some closed before anything is sent. The TLS transport must refuse
    every one without disturbing its links. Returns (connections made, errors)."""
    made, errors = 0, 0
    for i in range(count):
        ip, port = targets[i % len(targets)]
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(2.0)
                s.connect((ip, port))
                r = rng.random()
                if r < 0.5:
                    size = rng.randint(0, 2000)
                    body = bytes([0x16, 0x03, rng.choice([1, 3])]) + rng.randrange(1 << 16).to_bytes(2, "big") + (rng.getrandbits(8 * size).to_bytes(size, "big") if size else b"")
                elif r < 0.9:
                    size = rng.randint(1, 4000)
                    body = rng.getrandbits(8 * size).to_bytes(size, "big")
                else:
                    body = b""
                if body:
                    s.sendall(body)
            made += 1
        except OSError:
            errors += 1
    return made, errors


# ----------------------------------------------------------------------------- one run


class Events:
    """Incremental reader of a run's events.jsonl (only whole lines)."""

    def __init__(self, path):
        self.path, self.offset, self.buf, self.all = path, 0, b"", []
        self.committed = -1
        self.gens = []

    def pump(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            e["_i"] = len(self.all)
            self.all.append(e)
            if e["event"] == "committed":
                self.committed = max(self.committed, e["step"])
            elif e["event"] == "generation":
                self.gens.append(e)

    def of(self, kind):
        return [e for e in self.all if e["event"] == kind]


class Run:
    def __init__(self, args, key, run_dir, config_text, disturbed, plan, seed):
        self.args, self.key, self.dir, self.config_text = args, key, run_dir, config_text
        self.disturbed, self.plan, self.seed = disturbed, plan, seed
        self.out = os.path.join(run_dir, "out")
        self.ev = Events(os.path.join(self.out, "events.jsonl"))
        self.pids_seen = set()
        self.rings = set()
        self.actions = []
        self.failures = []
        self.notes = []
        self.proc = None
        self.finished_launcher = False
        self.threads = []

    # -- helpers

    def fail(self, check, detail):
        self.failures.append({"check": check, "detail": detail})
        log(f"    FAIL {check}: {detail}")

    def exited(self):
        if self.proc.poll() is not None:
            self.finished_launcher = True
        return self.finished_launcher

    def observe(self):
        self.ev.pump()
        for g in self.ev.gens:
            self.pids_seen.update(g.get("pids", []))
        for e in self.ev.of("joined"):
            self.pids_seen.add(e["pid"])

    def scan_processes(self):
        """Collects the run's processes (catches replacements that never joined) and the shm
        rings they map."""
        procs = processes_of_run(self.out)
        procs.discard(self.proc.pid)
        self.pids_seen.update(procs)
        if self.transport == "shm":
            self.rings.update(shm_jobs_of(procs))

    def wait_until(self, pred, timeout, what):
        """Pumps events until `pred()` holds; False on timeout or when the launcher has exited."""
        start, last_scan = time.time(), 0.0
        while True:
            self.observe()
            if pred():
                return True
            if self.exited():
                self.observe()
                return pred()
            now = time.time()
            if now - start > timeout:
                self.notes.append(f"timed out after {timeout:.0f} s waiting for {what}")
                return False
            if now - last_scan > 0.25:
                self.scan_processes()
                last_scan = now
            time.sleep(0.005)

    def current_generation(self):
        return self.ev.gens[-1] if self.ev.gens else None

    def pump_for(self, seconds):
        end = time.time() + seconds
        while time.time() < end:
            self.observe()
            time.sleep(0.005)

    def settled(self, pending):
        """True when the disturbance `pending` has been repaired: the group re-formed after the
        loss and the new generation committed a step (with `replace`, back at N workers); or,
        for a stopped worker that was not evicted, training went on after SIGCONT."""
        lost = next((e for e in self.ev.all[pending["index"] + 1:] if e["event"] == "lost" and e["pid"] == pending["victim"]), None)
        if lost is None:
            return pending.get("cont_step") is not None and self.ev.committed >= pending["cont_step"] + 3
        gens = [g for g in self.ev.gens if g["_i"] > lost["_i"]]
        if not gens:
            return False
        g = gens[-1]
        if self.policy == "replace" and g["world"] < self.args.workers:
            return False
        return any(e["event"] == "committed" and e["generation"] == g["generation"] for e in self.ev.all[g["_i"]:])

    # -- the run

    def start(self):
        os.makedirs(self.dir, exist_ok=True)
        cfg = os.path.join(self.dir, "config.toml")
        with open(cfg, "w") as f:
            f.write(self.config_text)
        cmd = [self.args.rtx, "launch", "--nproc", str(self.args.workers), "--no-progress", "--out", self.out, "--data-dir", self.args.data_dir, cfg]
        self.log_file = open(os.path.join(self.dir, "launch.log"), "wb")
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info")
        self.t_start = time.time()
        # A process group of its own, so a hung launch can be ended with everything it started.
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO)

    def execute(self):
        pending = None  # the last kill or stop, until it is repaired
        base = 0
        if not self.wait_until(lambda: self.ev.committed >= 0, 120, "the first committed step"):
            self.fail("job_started", "no committed step " + ("(launcher exited)" if self.exited() else "within 120 s"))
            return
        for a in self.plan:
            act = dict(a)
            self.actions.append(act)
            if a["kind"] in ("kill", "stop") and pending is not None:
                # Wait for the previous disturbance to be repaired before the next one, so each
                # recovery is measured on its own.
                p = pending
                if not self.wait_until(lambda: self.settled(p), self.args.settle_timeout, "the previous recovery") and not self.exited():
                    self.fail("recovered", f"action {a['i']} ({a['kind']}): the previous disturbance ({p['kind']} of pid {p['victim']}) was not repaired within {self.args.settle_timeout:.0f} s")
                pending = None
            # Gaps count from where the previous action left the job (after its recovery).
            self.observe()
            base = max(base, self.ev.committed)
            target = base + a["gap"]
            if not self.wait_until(lambda: self.ev.committed >= target, self.args.settle_timeout, f"step {target}"):
                act["skipped"] = "the job ended first" if self.exited() else f"step {target} not reached"
                log(f"    action {a['i']} {a['kind']}: skipped ({act['skipped']})")
                continue
            time.sleep(a["jitter_ms"] / 1000.0)
            self.observe()
            gen = self.current_generation()
            pids = gen["pids"]
            act["generation"] = gen["generation"]
            act["committed_seen"] = self.ev.committed
            elapsed = time.time() - self.t_start
            if a["kind"] in ("kill", "stop"):
                victim = pids[a["slot"] % len(pids)]
                act.update(victim=victim, rank=pids.index(victim))
                pending = {"index": len(self.ev.all) - 1, "victim": victim, "kind": a["kind"]}
            if a["kind"] == "kill":
                log(f"    [{elapsed:6.1f}s] kill -9 rank {act['rank']} (pid {victim}) at committed step {act['committed_seen']}")
                act["t"] = time.time()
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    act["skipped"] = "victim already gone"
            elif a["kind"] == "stop":
                log(f"    [{elapsed:6.1f}s] SIGSTOP rank {act['rank']} (pid {victim}) for {self.args.stop_seconds:.1f} s at committed step {act['committed_seen']}")
                act["seconds"] = self.args.stop_seconds
                act["t"] = time.time()
                try:
                    os.kill(victim, signal.SIGSTOP)
                except ProcessLookupError:
                    act["skipped"] = "victim already gone"
                    continue
                self.pump_for(self.args.stop_seconds)
                try:
                    os.kill(victim, signal.SIGCONT)
                    act["cont"] = "sent"
                except ProcessLookupError:
                    act["cont"] = "the process was gone (evicted and killed)"
                self.observe()
                pending["cont_step"] = self.ev.committed
            elif a["kind"] == "garbage":
                self.garbage(act)
            elif a["kind"] == "wrong_token":
                self.wrong_token(act)
            if a["kind"] not in ("kill", "stop"):
                self.observe()
                base = max(base, self.ev.committed)

    # Garbage and wrong tokens run on threads beside the training (they must not hold up the
    # plan: on two cores, 20,000 datagrams take up to seconds); `finish` joins them.

    def background(self, act, work):
        t = threading.Thread(target=work, args=(act,), daemon=True)
        t.start()
        self.threads.append(t)

    def garbage(self, act):
        with open(os.path.join(self.out, "cluster.json")) as f:
            cluster = json.load(f)
        host, port = cluster["supervisor"].rsplit(":", 1)
        targets = [(host.strip("[]"), int(port))]
        workers = [p for p in self.current_generation()["pids"] if proc_alive(p)]
        worker_ports = udp_ports_of(workers)
        targets += [t for t in worker_ports if t not in targets]
        # Over TLS the collective frames ride TCP: junk connections at the workers' listeners too.
        tcp_targets = tcp_listeners_of(workers) if self.transport == "tls" else []
        act.update(targets=[f"{h}:{p}" for h, p in targets], worker_ports=len(worker_ports), tcp_targets=[f"{h}:{p}" for h, p in tcp_targets], t=time.time())
        log(f"    [{time.time() - self.t_start:6.1f}s] {self.args.garbage} garbage datagrams at the supervisor {cluster['supervisor']} and {len(worker_ports)} worker UDP port(s)")
        if not worker_ports:
            self.notes.append("no worker UDP port found for the garbage datagrams")
        if self.transport == "tls" and not tcp_targets:
            self.notes.append("no worker TCP listener found for the garbage connections")

        def send(act):
            rng = random.Random(f"garbage:{self.seed}")
            t0 = time.time()
            # TCP first: a listener lives only as long as its generation's transport, and the
            # datagrams take a while on two cores.
            if tcp_targets:
                made, failed = garbage_connections(rng, tcp_targets, GARBAGE_CONNECTIONS_PER_PORT * len(tcp_targets))
                act.update(connections=made, connection_errors=failed)
            sent, errors = garbage_datagrams(rng, targets, self.args.garbage)
            act.update(sent=sent, send_errors=errors, seconds=round(time.time() - t0, 3))

        self.background(act, send)

    def wrong_token(self, act):
        with open(os.path.join(self.out, "cluster.json")) as f:
            addr = json.load(f)["supervisor"]
        with open(os.path.join(self.out, "token")) as f:
            token = f.read().strip()
        wrong = random.Random(f"token:{self.seed}").getrandbits(256).to_bytes(32, "big").hex()
        if wrong == token:
            wrong = "0" + wrong[1:]
        env = dict(os.environ, RTX_TOKEN=wrong, RTX_DATA_DIR=self.args.data_dir)
        act["t"] = time.time()
        log(f"    [{time.time() - self.t_start:6.1f}s] rtx status and rtx worker --join with a wrong token")

        def attempt(act):
            res = {}
            for name, cmd in (("status", [self.args.rtx, "status", addr]), ("worker", [self.args.rtx, "worker", "--join", addr])):
                try:
                    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, cwd=self.dir)
                    text = (p.stdout + p.stderr).decode(errors="replace")
                    res[name] = {"rc": p.returncode, "says_wrong_token": "wrong cluster token" in text, "tail": text.strip()[-300:]}
                except subprocess.TimeoutExpired:
                    res[name] = {"rc": None, "says_wrong_token": False, "tail": "timed out after 60 s"}
            # The right token still works (so the refusal is about the token, not a dead supervisor).
            try:
                p = subprocess.run([self.args.rtx, "status", addr], env=dict(env, RTX_TOKEN=token), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
                res["status_right_token"] = {"rc": p.returncode, "tail": (p.stdout + p.stderr).decode(errors="replace").strip()[-400:]}
            except subprocess.TimeoutExpired:
                res["status_right_token"] = {"rc": None, "tail": "timed out"}
            act["result"] = res

        self.background(act, attempt)

    def finish(self):
        deadline = self.t_start + self.args.run_timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.observe()
            if int(time.time() * 4) % 2 == 0:
                self.scan_processes()
            time.sleep(0.02)
        self.timed_out = self.proc.poll() is None
        for t in self.threads:
            t.join(timeout=120)
        if self.timed_out:
            self.fail("launcher_exit", f"rtx launch still running after {self.args.run_timeout:.0f} s")
        self.rc = self.proc.returncode
        self.wall_s = time.time() - self.t_start
        self.observe()
        # Orphans: nothing of the run may outlive the launcher. A process killed a moment before
        # the launcher returned may still be in the kernel's hands: allow 0.5 s.
        t_exit = time.time()
        orphans = []
        while True:
            self.pids_seen.update(processes_of_run(self.out))
            self.pids_seen.discard(self.proc.pid)
            orphans = sorted(p for p in self.pids_seen if proc_alive(p))
            if not orphans or self.timed_out or time.time() - t_exit > 0.5:
                break
            time.sleep(0.05)
        self.orphans = orphans
        if orphans and not self.timed_out:
            self.fail("no_orphans", f"{len(orphans)} process(es) of the run alive after the launcher exited: {orphans}")
        # Clean up whatever is left (our own launch's processes, by pid), then the launcher group.
        for p in orphans:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.timed_out:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.log_file.close()
        self.rings_left = shm_files_left(self.rings)


def analyse(run, reference_acc):
    """Measures and checks one finished run; returns its record."""
    ev = run.ev.all
    a = run.args
    rec = {"key": run.key, "transport": run.transport, "policy": run.policy, "sharding": run.sharding, "seed": run.seed, "disturbed": run.disturbed,
           "workers": a.workers, "steps": a.steps, "out": run.out, "rc": run.rc, "wall_s": round(run.wall_s, 2)}
    # The job's end.
    fin = [e for e in ev if e["event"] == "finished"]
    failed = [e for e in ev if e["event"] == "failed"]
    if run.rc != 0 and not run.timed_out:
        tail = ""
        try:
            with open(os.path.join(run.dir, "launch.log"), "rb") as f:
                tail = f.read()[-400:].decode(errors="replace").strip().replace("\n", " | ")
        except OSError:
            pass
        run.fail("launcher_exit", f"rtx launch exited with {run.rc}: {tail}")
    if failed:
        run.fail("job_finished", f"failed event: {failed[-1].get('reason')}")
    if not fin:
        run.fail("job_finished", "no finished event")
        rec["test_acc"] = None
    else:
        f = fin[-1]
        evald = {k: v for k, v in f.get("eval", [])}
        metric = getattr(a, "metric", "test_acc")
        rec["eval"] = evald
        # `test_acc` holds the compared metric (--metric; test accuracy unless told otherwise).
        rec["test_acc"] = evald.get(metric)
        rec["checksum"] = f.get("checksum")
        rec["replicas_identical"] = f.get("replicas_identical")
        if f.get("replicas_identical") is not True:
            run.fail("replicas_identical", f"finished with replicas_identical = {f.get('replicas_identical')}")
        if metric == "none":
            pass
        elif rec["test_acc"] is None:
            run.fail("accuracy", f"the finished event has no {metric} (eval: {sorted(evald)})")
        elif reference_acc is not None and abs(rec["test_acc"] - reference_acc) > a.acc_tol:
            run.fail("accuracy", f"{metric} {rec['test_acc']:.4f} vs undisturbed {reference_acc:.4f} (tolerance {a.acc_tol})")
    rec["reference_acc"] = reference_acc
    committed_max = max((e["step"] for e in ev if e["event"] == "committed"), default=-1)
    rec["committed_max"] = committed_max

    # Regressions and re-runs, over every generation after the first.
    gens = [e for e in ev if e["event"] == "generation"]
    se = elastic_setting(run.config_text, "snapshot_every", 25)
    ce = elastic_setting(run.config_text, "checkpoint_every", 0)
    regressions, skips, gen_records = [], [], []
    for prev, g in zip(gens, gens[1:]):
        before = [e for e in ev[:g["_i"]] if e["event"] == "committed"]
        last = max((e["step"] for e in before), default=-1)
        ckpt = max((e["step"] for e in ev[:g["_i"]] if e["event"] == "checkpointed"), default=-1)
        survivors = sorted(set(prev["pids"]) & set(g["pids"]))
        durable, why = ckpt + 1, f"checkpoint after step {ckpt}" if ckpt >= 0 else "no checkpoint"
        if survivors:
            if run.sharding in ("zero1", "zero2"):
                snap = max(((last + 1) // se) * se, ((last + 1) // ce) * ce if ce else 0, prev["next_step"])
                if snap > durable:
                    durable, why = snap, f"ZeRO-1 snapshot at step {snap} (snapshot_every {se}) held by survivors {survivors}"
            elif last + 1 > durable:
                durable, why = last + 1, f"step {last} committed and held by survivors {survivors}"
        nxt = g["next_step"]
        gr = {"generation": g["generation"], "world": g["world"], "next_step": nxt, "last_committed": last, "durable_next": durable, "rerun": max(0, last + 1 - nxt)}
        gen_records.append(gr)
        if nxt < durable:
            regressions.append(gr)
            run.fail("no_regression", f"generation {g['generation']} resumed at step {nxt}, below the newest durable state ({why}: next step {durable})")
        if nxt > last + 2 and last >= 0:
            skips.append(gr)
            run.fail("no_skipped_steps", f"generation {g['generation']} resumed at step {nxt} but the last committed step was {last}")
    rec["generations"] = gen_records
    rec["regressions"] = len(regressions)

    # Per kill / stop: detection, recovery, re-run.
    lost = [e for e in ev if e["event"] == "lost"]
    caused = set()
    kills, stops = [], []
    for act in run.actions:
        if act["kind"] not in ("kill", "stop") or "t" not in act or act.get("skipped"):
            continue
        victim, t = act["victim"], act["t"]
        caused.add(victim)
        lo = next((e for e in lost if e["pid"] == victim and e["unix_s"] >= t - 0.05), None)
        r = {"i": act["i"], "kind": act["kind"], "victim": victim, "rank": act["rank"], "committed_seen": act["committed_seen"]}
        if lo is None:
            if act["kind"] == "kill":
                run.fail("kill_detected", f"kill {act['i']} of pid {victim}: no lost event")
            r["evicted"] = False
            (kills if act["kind"] == "kill" else stops).append(r)
            continue
        r["class"] = lo.get("class")
        r["detect_s"] = round(lo["unix_s"] - t, 4)
        r["evicted"] = True
        rg = next((g for g in gens if g["_i"] > lo["_i"]), None)
        if rg is None:
            if not (fin and fin[-1]["_i"] > lo["_i"]):
                run.fail("recovered", f"{act['kind']} {act['i']} of pid {victim}: no generation after the loss")
            (kills if act["kind"] == "kill" else stops).append(r)
            continue
        last = max((e["step"] for e in ev[:rg["_i"]] if e["event"] == "committed"), default=-1)
        r.update(generation=rg["generation"], world=rg["world"], next_step=rg["next_step"], last_committed=last, rerun=max(0, last + 1 - rg["next_step"]))
        # The next committed step, in the recovery generation or a later one (with `replace`, the
        # replacement may join and re-form the group before the shrunk one commits anything).
        nc = next((e for e in ev[rg["_i"]:] if e["event"] == "committed"), None)
        r["generation_s"] = round(rg["unix_s"] - t, 4)
        if nc is not None:
            r["recovery_s"] = round(nc["unix_s"] - t, 4)
            r["recovery_generation"] = nc["generation"]
        elif rg["next_step"] < (committed_max + 1) or not fin:
            run.fail("recovered", f"{act['kind']} {act['i']}: no step committed after generation {rg['generation']}")
        if a.stall_limit and r.get("recovery_s", 0) > a.stall_limit:
            run.fail("recovery_stalled", f"{act['kind']} {act['i']} of pid {victim}: next committed step only after {r['recovery_s']:.1f} s (limit {a.stall_limit:.0f} s)")
        if act["kind"] == "kill" and r.get("class") != "Crash":
            run.notes.append(f"kill {act['i']} was classed {r.get('class')}, not Crash")
        (kills if act["kind"] == "kill" else stops).append(r)
    rec["kills"] = kills
    rec["stops"] = stops
    # Losses nobody caused (garbage datagrams, a survivor dragged down by a peer's death, ...).
    collateral = [e for e in lost if e["pid"] not in caused]
    rec["collateral_losses"] = [{"pid": e["pid"], "class": e.get("class"), "reason": e.get("reason")} for e in collateral]
    for e in collateral:
        run.fail("no_collateral_loss", f"worker pid {e['pid']} lost ({e.get('class')}: {e.get('reason')}) without being killed or stopped")
    # Replacements.
    if run.policy == "replace" and run.disturbed:
        joined = [e for e in ev if e["event"] == "joined"]
        rec["joined"] = len(joined)
        evicted = sum(1 for k in kills + stops if k.get("evicted"))
        # Every loss but possibly the last (the job may end before its replacement joins).
        if len(joined) < a.workers + evicted - 1:
            run.fail("replaced", f"{len(joined)} joins for {a.workers} workers and {evicted} losses")
    # Garbage and wrong tokens.
    for act in run.actions:
        if act["kind"] == "garbage" and not act.get("skipped"):
            rec["garbage"] = {k: act.get(k) for k in ("sent", "send_errors", "targets", "worker_ports", "tcp_targets", "connections", "connection_errors", "seconds")}
            if act.get("sent", 0) < a.garbage * 0.99:
                run.fail("garbage_sent", f"only {act.get('sent')} of {a.garbage} datagrams sent")
        if act["kind"] == "wrong_token" and not act.get("skipped"):
            res = act.get("result")
            if res is None:
                run.fail("wrong_token_refused", "the wrong-token attempts did not complete")
                continue
            # The worker's attempt must be a `refused` event (the status query is refused by an
            # error reply, which is not an event).
            res["refused_events"] = sum(1 for e in ev if e["event"] == "refused" and "wrong cluster token" in e.get("reason", "") and e["unix_s"] >= act["t"] - 0.05)
            rec["wrong_token"] = res
            # The job may finish between the plan's step check and the attempt (a group shrunk to
            # one worker runs the last steps fast): then no supervisor is left to refuse anyone.
            # That is the plan not carried out (raise --steps), not a refusal that failed.
            unanswered = all(not res[name]["says_wrong_token"] for name in ("status", "worker"))
            if unanswered and fin and fin[-1]["unix_s"] <= act["t"] + 0.05:
                act["skipped"] = "the job ended first"
                continue
            for name in ("status", "worker"):
                if res[name]["rc"] in (0, None) or not res[name]["says_wrong_token"]:
                    run.fail("wrong_token_refused", f"rtx {name} with a wrong token: exit {res[name]['rc']}, output: {res[name]['tail']!r}")
            if res["refused_events"] < 1:
                run.fail("wrong_token_refused", "no `refused` event (wrong cluster token) for the worker's attempt")
            if res["status_right_token"]["rc"] != 0:
                run.fail("right_token_accepted", f"rtx status with the right token: exit {res['status_right_token']['rc']}: {res['status_right_token']['tail']!r}")
    # Plan completeness.
    skipped = [act for act in run.actions if act.get("skipped")]
    rec["actions"] = [{k: v for k, v in act.items() if k != "result"} for act in run.actions]
    if run.disturbed and skipped:
        run.fail("plan_complete", f"{len(skipped)} action(s) not carried out ({'; '.join(str(s['i']) + ' ' + s['kind'] + ': ' + s['skipped'] for s in skipped)}); raise --steps")
    rec["orphans"] = run.orphans
    rec["pids_seen"] = len(run.pids_seen)
    rec["shm_run_ids"] = sorted(r for _, r in run.rings)
    rec["shm_rings_left"] = run.rings_left
    if run.rings_left:
        run.fail("no_shm_leak", f"{len(run.rings_left)} shared-memory ring file(s) of the run left after it: {run.rings_left[:3]}")
    rec["notes"] = run.notes
    rec["failures"] = run.failures
    return rec


# ----------------------------------------------------------------------------- matrix and report


def parse_seeds(text):
    seeds = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            lo, hi = part.split("..")
            seeds.extend(range(int(lo), int(hi)))
        elif part:
            seeds.append(int(part))
    return seeds


def cells(transports, policies, shardings, matrix):
    full = [(t, p, s) for t in transports for p in policies for s in shardings]
    if matrix == "full":
        return full
    # Pairwise: every pair of values of any two factors appears in some run (a 2^3 half fraction
    # when every factor has two values).
    chosen, need = [], set()
    for (f1, f2) in ((0, 1), (0, 2), (1, 2)):
        for c in full:
            need.add((f1, c[f1], f2, c[f2]))
    while need:
        best = max(full, key=lambda c: sum((f1, c[f1], f2, c[f2]) in need for (f1, f2) in ((0, 1), (0, 2), (1, 2))))
        chosen.append(best)
        for (f1, f2) in ((0, 1), (0, 2), (1, 2)):
            need.discard((f1, best[f1], f2, best[f2]))
    return chosen


def pct(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


def fmt_s(x):
    return "-" if x is None else f"{x:.2f}"


def table(records, refs):
    """Rows per (transport, sharding), and per transport."""
    groups = {}
    for r in records:
        if not r["disturbed"]:
            continue
        for key in ((r["transport"], r["sharding"]), (r["transport"], "all")):
            groups.setdefault(key, []).append(r)
    rows = []
    for (t, s), rs in sorted(groups.items()):
        kills = [k for r in rs for k in r["kills"]]
        rec = [k["recovery_s"] for k in kills if "recovery_s" in k]
        det = [k["detect_s"] for k in kills if "detect_s" in k]
        rerun = [k["rerun"] for k in kills if "rerun" in k]
        stops = [k for r in rs for k in r["stops"]]
        accs = [r["test_acc"] for r in rs if r.get("test_acc") is not None]
        ref = [refs[x] for x in sorted(refs) if (s == "all" or x == s) and refs[x] is not None]
        rows.append({
            "transport": t, "sharding": s, "runs": len(rs), "seeds": len({r["seed"] for r in rs}), "kills": len(kills), "stops": len(stops),
            "recovery_median_s": statistics.median(rec) if rec else None, "recovery_p95_s": pct(rec, 0.95), "recovery_max_s": max(rec) if rec else None,
            "detect_median_s": statistics.median(det) if det else None,
            "rerun_mean": statistics.mean(rerun) if rerun else None, "rerun_max": max(rerun) if rerun else None,
            "zero1_rerun_max": max((k["rerun"] for r in rs if r["sharding"] in ("zero1", "zero2") for k in r["kills"] if "rerun" in k), default=None),
            "same_bits": sum(1 for r in rs if r.get("same_bits")), "same_bits_known": sum(1 for r in rs if r.get("same_bits") is not None),
            "stop_recovery_max_s": max((k["recovery_s"] for k in stops if "recovery_s" in k), default=None),
            "acc_min": min(accs) if accs else None, "acc_mean": statistics.mean(accs) if accs else None, "acc_reference": statistics.mean(ref) if ref else None,
            "orphans": sum(len(r["orphans"]) for r in rs), "regressions": sum(r["regressions"] for r in rs),
            "collateral": sum(len(r["collateral_losses"]) for r in rs),
            "refusals_ok": all(not any(f["check"].startswith("wrong_token") for f in r["failures"]) for r in rs),
            "workers": min(r["workers"] for r in rs),
        })
    return rows


def print_table(rows):
    head = f"{'transport':<9} {'sharding':<10} {'runs':>4} {'kills':>5} {'stops':>5} | {'recovery med/p95/max s':>22} {'detect med':>10} | {'re-run mean/max':>15} | {'acc (undisturbed)':>17} | {'orphans':>7} {'regress':>7} {'collat':>6} {'refused':>7}"
    log(head)
    log("-" * len(head))
    for r in rows:
        rec = f"{fmt_s(r['recovery_median_s'])}/{fmt_s(r['recovery_p95_s'])}/{fmt_s(r['recovery_max_s'])}"
        rerun = "-" if r["rerun_mean"] is None else f"{r['rerun_mean']:.1f}/{r['rerun_max']}"
        acc = "-" if r["acc_mean"] is None else f"{r['acc_mean']:.4f} ({'-' if r['acc_reference'] is None else format(r['acc_reference'], '.4f')})"
        log(f"{r['transport']:<9} {r['sharding']:<10} {r['runs']:>4} {r['kills']:>5} {r['stops']:>5} | {rec:>22} {fmt_s(r['detect_median_s']):>10} | {rerun:>15} | {acc:>17} | {r['orphans']:>7} {r['regressions']:>7} {r['collateral']:>6} {'ok' if r['refusals_ok'] else 'FAIL':>7}")


def bars(rows):
    """The long variant's bars, per transport."""
    out = []
    for r in rows:
        if r["sharding"] != "all":
            continue
        t = r["transport"]
        out.append((f"{t}: >= {BAR_WORKERS} workers", r["workers"] >= BAR_WORKERS, f"{r['workers']}"))
        out.append((f"{t}: >= {BAR_KILLS_PER_TRANSPORT} kills", r["kills"] >= BAR_KILLS_PER_TRANSPORT, f"{r['kills']}"))
        out.append((f"{t}: >= {BAR_SEEDS_PER_TRANSPORT} seeds", r["seeds"] >= BAR_SEEDS_PER_TRANSPORT, f"{r['seeds']}"))
        out.append((f"{t}: 0 regressions", r["regressions"] == 0, f"{r['regressions']}"))
        out.append((f"{t}: recovery median <= {BAR_RECOVERY_MEDIAN_S} s", r["recovery_median_s"] is not None and r["recovery_median_s"] <= BAR_RECOVERY_MEDIAN_S, fmt_s(r["recovery_median_s"])))
        out.append((f"{t}: recovery max <= {BAR_RECOVERY_MAX_S} s", r["recovery_max_s"] is not None and r["recovery_max_s"] <= BAR_RECOVERY_MAX_S, fmt_s(r["recovery_max_s"])))
        out.append((f"{t}: 0 orphans", r["orphans"] == 0, f"{r['orphans']}"))
        if r["zero1_rerun_max"] is not None:
            out.append((f"{t}: ZeRO-1/2 <= {BAR_ZERO1_RERUN_MAX} step re-run per kill", r["zero1_rerun_max"] <= BAR_ZERO1_RERUN_MAX, f"max {r['zero1_rerun_max']}"))
    return out


# ----------------------------------------------------------------------------- self-test


def self_test():
    """Feeds the analysis synthetic event logs with known faults (a regression to step 0, a
    ZeRO-1 resume below its snapshot, a loss nobody caused, replicas that differ, a wrong token
    let in, accuracy off) and a clean one, and checks that exactly the planted faults are named;
    then checks that the orphan scan finds a process that carries the run's folder."""
    cfg = make_config("[train]\nsteps = 100\n[elastic]\nheartbeat_interval_ms = 100\n", 100, {"sharding": "replicated", "checkpoint_every": 50})
    assert "steps = 100" in cfg and 'sharding = "replicated"' in cfg and cfg.count("[elastic]") == 1, cfg

    def fake(events, sharding="replicated", actions=None, acc=0.85, identical=True, extra_actions=()):
        r = Run.__new__(Run)
        r.args = argparse.Namespace(workers=3, steps=100, acc_tol=0.03, garbage=10, enforce_bars=False, stall_limit=15.0)
        r.key, r.transport, r.policy, r.sharding, r.seed, r.disturbed = "self-test", "quic", "shrink", sharding, 0, True
        r.out, r.dir, r.rc, r.wall_s, r.timed_out = "/nonexistent", "/nonexistent", 0, 1.0, False
        r.config_text = make_config("[train]\nsteps = 100\n", 100, {"sharding": sharding, "snapshot_every": 25})
        r.orphans, r.pids_seen, r.rings, r.rings_left, r.notes, r.failures = [], set(), set(), [], [], []
        evs = list(events) + [{"event": "finished", "eval": [["test_acc", acc]], "replicas_identical": identical, "unix_s": 999.0}]
        for i, e in enumerate(evs):
            e["_i"] = i
        r.ev = argparse.Namespace(all=evs)
        r.actions = list(actions or [{"i": 0, "kind": "kill", "victim": 2, "rank": 1, "t": 100.0, "committed_seen": 60}]) + list(extra_actions)
        return r

    def log_with(next_step, lost_pid=2, ckpt=None):
        evs = [{"event": "generation", "generation": 1, "next_step": 0, "pids": [1, 2, 3], "world": 3, "unix_s": 1.0}]
        evs += [{"event": "committed", "step": s, "generation": 1, "unix_s": 2.0 + s / 100} for s in range(61)]
        if ckpt is not None:
            evs.append({"event": "checkpointed", "step": ckpt, "unix_s": 2.5})
        evs.append({"event": "lost", "pid": lost_pid, "class": "Crash", "unix_s": 100.01})
        evs.append({"event": "generation", "generation": 2, "next_step": next_step, "pids": [p for p in (1, 2, 3) if p != lost_pid], "world": 2, "unix_s": 100.2})
        evs += [{"event": "committed", "step": s, "generation": 2, "unix_s": 100.3 + (s - next_step) / 1000} for s in range(next_step, 100)]
        return evs

    def checks(run):
        return sorted({f["check"] for f in run.failures})

    cases = []
    clean = fake(log_with(61))
    rec = analyse(clean, 0.85)
    cases.append(("clean run", checks(clean), []))
    assert abs(rec["kills"][0]["recovery_s"] - 0.3) < 1e-6 and rec["kills"][0]["rerun"] == 0 and abs(rec["kills"][0]["detect_s"] - 0.01) < 1e-6, rec["kills"]
    back = fake(log_with(0))
    rec = analyse(back, 0.85)
    cases.append(("regression to step 0", checks(back), ["no_regression"]))
    assert rec["kills"][0]["rerun"] == 61
    z = fake(log_with(40), sharding="zero1")
    cases.append(("ZeRO-1 below its snapshot", (analyse(z, 0.85), checks(z))[1], ["no_regression"]))
    z = fake(log_with(50), sharding="zero1")
    rec = analyse(z, 0.85)
    cases.append(("ZeRO-1 at its snapshot", checks(z), []))
    assert rec["kills"][0]["rerun"] == 11
    c = fake(log_with(61, ckpt=59)[:-39] + [{"event": "generation", "generation": 3, "next_step": 55, "pids": [4], "world": 1, "unix_s": 101.0}])
    cases.append(("resume below the newest checkpoint", (analyse(c, 0.85), checks(c))[1], ["no_regression"]))
    col = fake(log_with(61), extra_actions=())
    col.ev.all.insert(-1, {"event": "lost", "pid": 3, "class": "Hang", "unix_s": 200.0, "_i": -1})
    for i, e in enumerate(col.ev.all):
        e["_i"] = i
    cases.append(("a loss nobody caused", (analyse(col, 0.85), checks(col))[1], ["no_collateral_loss"]))
    diff = fake(log_with(61), identical=False, acc=0.70)
    cases.append(("replicas differ, accuracy off", (analyse(diff, 0.85), checks(diff))[1], ["accuracy", "replicas_identical"]))
    wt = {"i": 1, "kind": "wrong_token", "t": 0.0, "result": {"status": {"rc": 0, "says_wrong_token": False, "tail": ""}, "worker": {"rc": 1, "says_wrong_token": True, "tail": ""},
                                                     "status_right_token": {"rc": 0, "tail": ""}, "refused_events": 0}}
    let_in = fake(log_with(61), extra_actions=[wt])
    cases.append(("wrong token let in", (analyse(let_in, 0.85), checks(let_in))[1], ["wrong_token_refused"]))
    ok_wt = {"i": 1, "kind": "wrong_token", "t": 0.0, "result": {"status": {"rc": 1, "says_wrong_token": True, "tail": ""}, "worker": {"rc": 1, "says_wrong_token": True, "tail": ""},
                                                                "status_right_token": {"rc": 0, "tail": ""}}}
    refused = fake([{"event": "refused", "reason": "wrong cluster token", "unix_s": 50.0}] + log_with(61), extra_actions=[ok_wt])
    cases.append(("wrong token refused", (analyse(refused, 0.85), checks(refused))[1], []))
    slow = log_with(61)
    for e in slow:
        if e["event"] == "committed" and e["generation"] == 2:
            e["unix_s"] += 30.0
    stalled = fake(slow)
    cases.append(("a 30 s recovery", (analyse(stalled, 0.85), checks(stalled))[1], ["recovery_stalled"]))
    # Wrong-token attempts made after the job finished (finished at 999.0 in `fake`): nobody left to
    # refuse them, which is the plan not carried out, not a refusal that failed.
    late_wt = {"i": 1, "kind": "wrong_token", "t": 1000.0, "result": {"status": {"rc": 1, "says_wrong_token": False, "tail": "no answer within 10s"},
                                                                     "worker": {"rc": 1, "says_wrong_token": False, "tail": "timed out"},
                                                                     "status_right_token": {"rc": 1, "tail": "no answer within 10s"}}}
    late = fake(log_with(61), extra_actions=[late_wt])
    cases.append(("wrong token after the job ended", (analyse(late, 0.85), checks(late))[1], ["plan_complete"]))
    skipped = fake(log_with(61), extra_actions=[{"i": 2, "kind": "kill", "skipped": "the job ended first"}])
    cases.append(("plan not carried out", (analyse(skipped, 0.85), checks(skipped))[1], ["plan_complete"]))
    bad = [(name, got, want) for name, got, want in cases if got != want]
    for name, got, want in cases:
        log(f"self-test: {name}: flagged {got or 'nothing'}" + ("" if got == want else f"  <-- expected {want or 'nothing'}"))
    # The orphan scan finds a process by the run folder in its environment.
    folder = f"/tmp/rtx-chaos-self-test-{os.getpid()}"
    child = subprocess.Popen(["sleep", "30"], env=dict(os.environ, RTX_RUN_DIR=folder))
    try:
        time.sleep(0.05)
        found = processes_of_run(folder)
    finally:
        child.kill()
        child.wait()
    log(f"self-test: orphan scan found {sorted(found)} (planted {child.pid})")
    if child.pid not in found:
        bad.append(("orphan scan", sorted(found), [child.pid]))
    if proc_alive(child.pid):
        bad.append(("reaped process still alive", [child.pid], []))
    log("self-test: " + ("OK" if not bad else f"FAILED: {[b[0] for b in bad]}"))
    return 0 if not bad else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog="Presets: " + "; ".join(f"{k}: " + ", ".join(f"{a}={b}" for a, b in v.items()) for k, v in PRESETS.items()))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="short")
    ap.add_argument("--rtx", default=os.environ.get("RTX_BIN") or os.path.join(REPO, "target", "release", "rtx"), help="the rtx binary (default $RTX_BIN, else target/release/rtx)")
    ap.add_argument("--config", default=os.path.join(REPO, "tests", "configs", "elastic_fashion.toml"))
    ap.add_argument("--data-dir", default=os.environ.get("RTX_DATA_DIR") or os.path.join(REPO, "data"))
    ap.add_argument("--out", default=None, help="folder of the runs and summary.json (default: a fresh folder under /tmp)")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--kills", type=int, help="kill -9 per run (shrink runs keep at least one worker)")
    ap.add_argument("--stops", type=int, help="SIGSTOPs per run")
    ap.add_argument("--stop-seconds", type=float)
    ap.add_argument("--garbage", type=int, help="garbage datagrams per run (0: none)")
    ap.add_argument("--no-wrong-token", action="store_true")
    ap.add_argument("--seeds", help="e.g. 1,2,3 or 0..3")
    ap.add_argument("--transports", help="quic,shm,tls (tls: the control plane over QUIC, collective frames over TLS on TCP: [elastic] data_transport = \"tls\")")
    ap.add_argument("--channels", type=int, default=1, help="[elastic] channels of every run (rings a large all-reduce is split into)")
    ap.add_argument("--connections", type=int, default=1, help="[elastic] connections of every run (QUIC or TCP connections per worker pair)")
    ap.add_argument("--policies", help="shrink,replace")
    ap.add_argument("--sharding", help="replicated,zero1,zero2")
    ap.add_argument("--metric", default="test_acc", help="the final eval metric compared with the undisturbed run: test_acc, val_loss (a text job), or none (a mesh job: no member holds the whole model to evaluate; the parameter bits are compared instead)")
    ap.add_argument("--matrix", choices=["full", "pairwise"])
    ap.add_argument("--steps", type=int, help="train.steps of every run")
    ap.add_argument("--checkpoint-every", type=int)
    ap.add_argument("--acc-tol", type=float, help="allowed |test accuracy - undisturbed|")
    ap.add_argument("--run-timeout", type=float, help="seconds one run may take")
    ap.add_argument("--settle-timeout", type=float, default=60.0, help="seconds to wait for a recovery before the next action")
    ap.add_argument("--stall-limit", type=float, default=15.0, help="a recovery slower than this fails the run, on any machine (0: off)")
    ap.add_argument("--no-reference", action="store_true", help="skip the undisturbed runs")
    ap.add_argument("--enforce-bars", dest="enforce_bars", action="store_true", default=None, help="a failed bar fails the harness (default with --preset long/sample)")
    ap.add_argument("--no-enforce-bars", dest="enforce_bars", action="store_false")
    ap.add_argument("--plan-only", action="store_true", help="print the plans and exit")
    ap.add_argument("--self-test", action="store_true", help="check the analysis on synthetic faults, and the orphan scan, then exit")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.rtx = os.path.abspath(args.rtx)
    args.data_dir = os.path.abspath(args.data_dir)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    shardings = [s.strip() for s in args.sharding.split(",") if s.strip()]
    seeds = parse_seeds(args.seeds)
    for name, vals, allowed in (("transports", transports, {"quic", "shm", "auto", "tls"}), ("policies", policies, {"shrink", "replace"}), ("sharding", shardings, {"replicated", "zero1", "zero2"})):
        if not vals or not set(vals) <= allowed:
            ap.error(f"--{name} takes a comma list of {sorted(allowed)}")
    if not seeds or args.workers < 2:
        ap.error("need at least one seed and two workers")
    with open(args.config) as f:
        base = f.read()
    run_cells = [(t, p, s, seed) for seed in seeds for (t, p, s) in cells(transports, policies, shardings, args.matrix)]

    log(f"chaos: preset {args.preset}, {len(run_cells)} disturbed run(s) + {0 if args.no_reference else len(shardings)} undisturbed, {args.workers} workers, "
        f"{args.kills} kill(s) + {args.stops} stop(s) of {args.stop_seconds:.1f} s per run, {args.garbage} garbage datagrams, wrong tokens {'off' if args.no_wrong_token else 'on'}, {args.steps} steps, seeds {seeds}")
    plans = {}
    for (t, p, s, seed) in run_cells:
        plan, notes = make_plan(seed, args.workers, args.kills, args.stops, args.garbage, not args.no_wrong_token, p, args.steps)
        plans[(t, p, s, seed)] = (plan, notes)
    if args.plan_only:
        for key, (plan, notes) in plans.items():
            log(f"{'/'.join(map(str, key))}: " + ", ".join(f"{a['kind']}@+{a['gap']}(slot {a['slot'] % args.workers}, +{a['jitter_ms']}ms)" for a in plan) + (f"  [{'; '.join(notes)}]" if notes else ""))
        return 0
    if not os.access(args.rtx, os.X_OK):
        log(f"chaos: no rtx binary at {args.rtx} (build it, or set RTX_BIN / --rtx)")
        return 2
    dataset = re.search(r'(?m)^dataset\s*=\s*"([^"]+)"', base)
    dataset = dataset.group(1) if dataset else "fashion-mnist"
    if not os.path.isdir(os.path.join(args.data_dir, dataset)):
        log(f"chaos: no {dataset} under {args.data_dir} (bash scripts/fetch-data.sh, or --data-dir)")
        return 2
    out = args.out or os.path.join("/tmp", f"rtx-chaos-{os.getpid()}-{int(time.time())}")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    records, refs, ref_checksums = [], {}, {}

    def one(key, transport, policy, sharding, seed, disturbed):
        overrides = {"transport": transport, "on_failure": policy, "sharding": sharding, "min_workers": 1}
        if transport == "tls":
            overrides.update(transport="quic", data_transport="tls")
        if args.channels > 1:
            overrides["channels"] = args.channels
        if args.connections > 1:
            overrides["connections"] = args.connections
        if args.checkpoint_every:
            overrides["checkpoint_every"] = args.checkpoint_every
        budget = args.kills + args.stops + 10
        if budget > 100:
            overrides["failure_budget"] = budget
        text = make_config(base, args.steps, overrides)
        plan, notes = plans.get((transport, policy, sharding, seed), ([], [])) if disturbed else ([], [])
        run = Run(args, key, os.path.join(out, key), text, disturbed, plan, seed)
        run.transport, run.policy, run.sharding = transport, policy, sharding
        run.notes.extend(notes)
        if disturbed:
            log(f"run {key}: plan " + ", ".join(f"{a['kind']}@+{a['gap']}" for a in plan) + (f" ({'; '.join(notes)})" if notes else ""))
        else:
            log(f"run {key}: undisturbed reference")
        run.start()
        try:
            if disturbed:
                run.execute()
        finally:
            run.finish()
        rec = analyse(run, refs.get(sharding) if disturbed else None)
        # Whether the run ended with the undisturbed run's parameter bits (reported, not a check:
        # a shrunken interval changes the batches a step sees; a mesh under `replace` waits for
        # the whole mesh and so may end bit-identical).
        ref_sum = ref_checksums.get(sharding)
        rec["same_bits"] = None if not disturbed or ref_sum is None or rec.get("checksum") is None else rec["checksum"] == ref_sum
        kills = rec["kills"]
        rec_s = [k["recovery_s"] for k in kills if "recovery_s" in k]
        log(f"  -> {key}: rc {rec['rc']}, {rec['wall_s']:.1f} s, {args.metric} {fmt_s(rec.get('test_acc')) if rec.get('test_acc') is None else format(rec['test_acc'], '.4f')}"
            + (f" (undisturbed {rec['reference_acc']:.4f})" if rec.get("reference_acc") is not None else "")
            + f", identical {rec.get('replicas_identical')}" + ("" if rec.get("same_bits") is None else f", undisturbed bits {rec['same_bits']}") + f", {len(kills)} kill(s)"
            + (f": recovery " + " ".join(f"{x:.2f}" for x in rec_s) + " s, detect " + " ".join(f"{k['detect_s']:.2f}" for k in kills if "detect_s" in k) + " s, re-run " + " ".join(str(k.get("rerun", "?")) for k in kills) if kills else "")
            + "".join(f", stop {k.get('class', 'not evicted')} recovery {fmt_s(k.get('recovery_s'))} s" for k in rec["stops"])
            + f", orphans {len(rec['orphans'])}, regressions {rec['regressions']}, {'OK' if not rec['failures'] else str(len(rec['failures'])) + ' FAILED'}")
        for n in rec["notes"]:
            log(f"     note: {n}")
        records.append(rec)
        return rec

    if not args.no_reference:
        for s in shardings:
            rec = one(f"ref-{transports[0]}-{s}", transports[0], "shrink", s, seeds[0], False)
            refs[s] = rec.get("test_acc")
            ref_checksums[s] = rec.get("checksum")
    for (t, p, s, seed) in run_cells:
        one(f"{t}-{p}-{s}-seed{seed}", t, p, s, seed, True)

    rows = table(records, refs)
    log("")
    for r in rows:
        if r["sharding"] == "all" and r["same_bits_known"]:
            log(f"{r['transport']}: {r['same_bits']} of {r['same_bits_known']} disturbed runs ended with the undisturbed run's parameter bits")
    log(f"chaos summary ({len(records)} runs, {time.time() - t0:.0f} s; times in seconds from the kill; re-run = steps trained again)")
    print_table(rows)
    failures = [dict(f, run=r["key"]) for r in records for f in r["failures"]]
    bar_results = bars(rows)
    log("")
    log("bars (long variant)" + ("" if args.enforce_bars else ", printed only:"))
    for name, ok, value in bar_results:
        log(f"  {'PASS' if ok else 'FAIL'}  {name}  ({value})")
    failed_bars = [b for b in bar_results if not b[1]]
    summary = {
        "preset": args.preset, "seconds": round(time.time() - t0, 1), "args": {k: v for k, v in vars(args).items()},
        "runs": records, "table": rows, "references": refs,
        "bars": [{"bar": n, "pass": ok, "value": v} for n, ok, v in bar_results],
        "failures": failures, "checks_failed": sorted({f["check"] for f in failures}),
        "ok": not failures and (not args.enforce_bars or not failed_bars),
    }
    path = os.path.join(out, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    log("")
    if failures:
        log(f"FAILED checks: {', '.join(summary['checks_failed'])}")
        for f in failures:
            log(f"  {f['run']}: {f['check']}: {f['detail']}")
    if args.enforce_bars and failed_bars:
        log(f"FAILED bars: {', '.join(b[0] for b in failed_bars)}")
    log(f"summary: {path}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
