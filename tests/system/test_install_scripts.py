"""scripts/install-system-deps.sh on a busy machine, run for real against stand-ins (a lock file
of its own, a fake apt-get, a policy-rc.d path in a temporary folder), so the machine's own apt
state is never touched: it waits for a held dpkg lock and says who holds it, gives up after its
bound, retries a failed fetch, and leaves no policy-rc.d behind when apt fails (putting back
one that was there before)."""
from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-system-deps.sh"

# A stand-in for apt-get: records each call (and whether policy-rc.d was in place), fails the
# calls named in FAKE_APT_FAIL ("update:1" fails the first update, "install" every install).
FAKE_APT = """#!/usr/bin/env bash
cmd=""
for a in "$@"; do case $a in update|install) cmd=$a ;; esac; done
n=$(grep -c "^$cmd" "$FAKE_APT_LOG" 2>/dev/null || true); n=${n:-0}
policy=absent; [ -x "$POLICY_RC_D" ] && policy=present
echo "$cmd policy-rc.d=$policy $*" >> "$FAKE_APT_LOG"
case " $FAKE_APT_FAIL " in
  *" $cmd "*) exit 100 ;;
  *" $cmd:1 "*) [ "$n" = 0 ] && exit 100 ;;
esac
exit 0
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "apt-get"
    fake.write_text(FAKE_APT)
    fake.chmod(0o755)
    lock = tmp_path / "lock-frontend"
    lock.touch()
    return {**os.environ, "APT_GET": str(fake), "APT_LOCK_FILES": str(lock), "SUDO": "",
            "POLICY_RC_D": str(tmp_path / "policy-rc.d"), "PACKAGES": "fake-package",
            "FAKE_APT_LOG": str(tmp_path / "apt.log"), "FAKE_APT_FAIL": "",
            "APT_RETRY_DELAY_S": "0"}


def run(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], env={**env, **extra}, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def held_lock(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """Another process holds the lock for 3 s (as an unattended upgrade would)."""
    holder = subprocess.Popen(["flock", "--exclusive", env["APT_LOCK_FILES"], "sleep", "3"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until /proc/locks shows it
        if any(f" {holder.pid} " in line for line in Path("/proc/locks").read_text().splitlines()):
            break
        time.sleep(0.02)
    yield holder
    holder.kill()
    holder.wait()


def test_waits_for_a_held_lock_saying_who_holds_it(env: dict[str, str],
                                                   held_lock: subprocess.Popen[bytes]) -> None:
    t0 = time.monotonic()
    r = run(env, DRY_RUN="1")
    waited = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert 2.0 <= waited < 10
    lines = r.stdout.splitlines()
    assert lines[0] == "install-system-deps: installing Debian packages: fake-package"
    assert lines[1].startswith(f"install-system-deps: waiting for {env['APT_LOCK_FILES']}, held "
                               f"by pid {held_lock.pid} (flock: flock --exclusive ")
    # the first word comes at once; bash's $SECONDS counts whole seconds, so a second's
    # boundary crossed while the lock's holder is looked up reads as 1 s
    assert re.search(r"\((0|1) s of at most 300 s\)$", lines[1]), lines[1]
    assert lines[2].startswith(f"install-system-deps: {env['APT_LOCK_FILES']} is free after ")
    assert "would run: " in r.stdout and "install -y -qq --no-install-recommends fake-package" \
        in r.stdout
    assert lines[-1] == "install-system-deps: dry run: nothing installed"
    assert not Path(env["FAKE_APT_LOG"]).exists()  # a dry run runs nothing
    assert not Path(env["POLICY_RC_D"]).exists()


def test_the_wait_is_bounded(env: dict[str, str], held_lock: subprocess.Popen[bytes]) -> None:
    r = run(env, APT_LOCK_TIMEOUT_S="1")
    assert r.returncode != 0
    # bash's SECONDS counts whole wall-clock seconds: on a loaded host the check after the
    # first sleep can read 2
    said = re.search(rf"gave up after (\d+) s: {re.escape(env['APT_LOCK_FILES'])} is still "
                     rf"held by pid {held_lock.pid} ", r.stderr)
    assert said is not None and 1 <= int(said.group(1)) <= 3, r.stderr
    assert not Path(env["FAKE_APT_LOG"]).exists()
    assert not Path(env["POLICY_RC_D"]).exists()


def test_a_failed_fetch_is_tried_again(env: dict[str, str]) -> None:
    r = run(env, FAKE_APT_FAIL="update:1")
    assert r.returncode == 0, r.stderr
    assert "apt-get update failed (exit status 100); trying again in 0 s (attempt 2 of 3)" \
        in r.stdout
    calls = Path(env["FAKE_APT_LOG"]).read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["update", "update", "install"]
    assert all("-o DPkg::Lock::Timeout=300" in c for c in calls)
    assert "policy-rc.d=present" in calls[-1]  # no service starts during the install
    assert r.stdout.splitlines()[-1].startswith("install-system-deps: installed fake-package in ")
    assert not Path(env["POLICY_RC_D"]).exists()


def test_no_policy_rc_d_is_left_behind_when_apt_fails(env: dict[str, str]) -> None:
    r = run(env, FAKE_APT_FAIL="install", APT_RETRIES="2")
    assert r.returncode == 100
    assert "install-system-deps: apt-get install failed 2 times (last exit status 100)" \
        in r.stderr
    assert not Path(env["POLICY_RC_D"]).exists()


def test_a_policy_rc_d_that_was_there_is_put_back(env: dict[str, str]) -> None:
    theirs = Path(env["POLICY_RC_D"])
    theirs.write_text("#!/bin/sh\nexit 0\n")
    r = run(env, FAKE_APT_FAIL="install", APT_RETRIES="1")
    assert r.returncode == 100
    calls = Path(env["FAKE_APT_LOG"]).read_text()
    assert "install policy-rc.d=present" in calls
    assert theirs.read_text() == "#!/bin/sh\nexit 0\n"
    assert not Path(str(theirs) + ".slogate-saved").exists()
