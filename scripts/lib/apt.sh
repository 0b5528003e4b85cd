# apt-get that survives a busy machine; sourced by the install scripts (bash).
#
#   apt_wait_for_lock   wait, at most APT_LOCK_TIMEOUT_S, while another process (unattended
#                       upgrades, a second install) holds dpkg's or apt's lock, saying every
#                       ~10 s which lock and who holds it
#   apt_run ARGS...     apt-get ARGS once the locks are free, tried APT_RETRIES times (a fetch
#                       that failed, a lock taken between our look and apt's own), with apt's
#                       own DPkg::Lock::Timeout as well (apt >= 1.9.11; older ones ignore it)
#
# Who holds a lock is read from /proc/locks (flock and fcntl locks alike, for any user), so
# neither fuser nor lsof is needed. The knobs exist for tests, which point them at fakes:
#   APT_GET (apt-get)  APT_LOCK_FILES (dpkg's and apt's three)  APT_LOCK_TIMEOUT_S (300)
#   APT_LOCK_SAY_S (10)  APT_RETRIES (3)  APT_RETRY_DELAY_S (5)  SUDO (sudo unless root)
#   DRY_RUN=1: print the apt-get commands instead of running them (the locks are still awaited)

APT_GET=${APT_GET:-apt-get}
APT_LOCK_FILES=${APT_LOCK_FILES:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock}
APT_LOCK_TIMEOUT_S=${APT_LOCK_TIMEOUT_S:-300}
APT_LOCK_SAY_S=${APT_LOCK_SAY_S:-10}
APT_RETRIES=${APT_RETRIES:-3}
APT_RETRY_DELAY_S=${APT_RETRY_DELAY_S:-5}
if [ -z "${SUDO+set}" ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
fi
APT_WHO=${APT_WHO:-$(basename "$0" .sh)}  # the prefix of every message

# The processes holding a lock on file $1 (pids, one a line; waiters are not holders).
_apt_lock_holders() {
    [ -e "$1" ] || return 0
    local dev ino id
    read -r dev ino < <(stat -L -c '%d %i' "$1") || return 0
    # /proc/locks names the file as major:minor:inode (hex, hex, decimal)
    id=$(printf '%02x:%02x:%s' $(((dev >> 8) & 0xfff)) $(((dev & 0xff) | ((dev >> 12) & 0xfff00))) "$ino")
    awk -v id="$id" '$2 != "->" { for (i = 1; i <= NF; i++) if ($i == id) print $(i - 1) }' \
        /proc/locks 2>/dev/null | sort -u
}

# "pid 1234 (unattended-upgr: /usr/bin/python3 /usr/bin/unattended-upgrade)"
_apt_describe() {
    local pid=$1 comm cmd
    if [ "$pid" -le 0 ] 2>/dev/null || [ ! -r "/proc/$pid/comm" ]; then
        echo "a process this shell cannot see (pid $pid)"
        return
    fi
    comm=$(cat "/proc/$pid/comm" 2>/dev/null)
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)
    echo "pid $pid (${comm}: ${cmd% })"
}

apt_wait_for_lock() {
    local start=$SECONDS said=-1 f pid held waited last=
    while :; do
        held= pid=
        for f in $APT_LOCK_FILES; do
            pid=$(_apt_lock_holders "$f" | head -n1)
            if [ -n "$pid" ]; then held=$f last=$f; break; fi
        done
        waited=$((SECONDS - start))
        if [ -z "$held" ]; then
            [ "$said" -ge 0 ] && echo "$APT_WHO: $last is free after ${waited} s; going on"
            return 0
        fi
        if [ "$waited" -ge "$APT_LOCK_TIMEOUT_S" ]; then
            echo "$APT_WHO: gave up after ${waited} s: $held is still held by $(_apt_describe "$pid")" >&2
            return 1
        fi
        if [ "$said" -lt 0 ] || [ $((waited - said)) -ge "$APT_LOCK_SAY_S" ]; then
            echo "$APT_WHO: waiting for $held, held by $(_apt_describe "$pid") (${waited} s of at most ${APT_LOCK_TIMEOUT_S} s)"
            said=$waited
        fi
        sleep 1
    done
}

apt_run() {
    local try=1 rc
    while :; do
        apt_wait_for_lock || return 1
        if [ "${DRY_RUN:-0}" = 1 ]; then
            echo "$APT_WHO: would run: $APT_GET $*"
            return 0
        fi
        rc=0
        $SUDO env DEBIAN_FRONTEND=noninteractive "$APT_GET" \
            -o DPkg::Lock::Timeout="$APT_LOCK_TIMEOUT_S" "$@" || rc=$?
        [ "$rc" = 0 ] && return 0
        if [ "$try" -ge "$APT_RETRIES" ]; then
            echo "$APT_WHO: apt-get $1 failed $try times (last exit status $rc)" >&2
            return "$rc"
        fi
        try=$((try + 1))
        echo "$APT_WHO: apt-get $1 failed (exit status $rc); trying again in ${APT_RETRY_DELAY_S} s (attempt $try of $APT_RETRIES)"
        sleep "$APT_RETRY_DELAY_S"
    done
}
