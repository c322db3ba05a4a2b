#!/bin/bash
# neuron-disagg-guard: powers off a host that boots but does not serve, or that has run its
# max_hours, so that it stops billing (launch sets the instances' shutdown behaviour to terminate).
#
#   neuron-disagg-guard watch [--once]   neuron-disagg-guard.service: every 30 s, until the host serves
#                                        or is powered off (--once: one round, for a test)
#   neuron-disagg-guard unit-failed ID   neuron-disagg-fatal@ID.service, which a unit's OnFailure= starts
#                                        once systemd has stopped restarting it (its start limit)
#
# Before powering off it writes one line to the serial console, which `neuron-disagg status` reads
# back with ec2:GetConsoleOutput: "neuron-disagg: FATAL: <reason>" for a host that cannot serve,
# "neuron-disagg: STOP: <reason>" for max_hours.
#
# Its settings, /etc/neuron-disagg/guard.env, come from the user data, written once at first boot:
#   SERVE_WITHIN_S  every URL of CHECKS must answer within this many seconds of each boot
#   CHECKS          the /health URLs of this host's vLLM instances (and of the router, on its host)
#   STOP_AT         max_hours as an absolute time (epoch seconds), so that a reboot keeps it; empty: never
#   MAX_HOURS       what STOP_AT was made of, for the message
# The serving deadline counts from each boot (the boot time in /proc/stat): a host rebooted after it
# served must load its model again. Installed as /opt/neuron-disagg/bin/neuron-disagg-guard by
# ami/scripts/50-units.sh. NEURON_DISAGG_ROOT prefixes every path so that a test can run it in a
# scratch directory.
set -uo pipefail

ROOT="${NEURON_DISAGG_ROOT:-}"
SETTINGS="$ROOT/etc/neuron-disagg/guard.env"
STATE="$ROOT/var/lib/neuron-disagg"
SERVED="$ROOT/run/neuron-disagg/served"  # on tmpfs: this boot's, kept if the guard itself restarts
INTERVAL_S="${NEURON_DISAGG_GUARD_INTERVAL_S:-30}"
FATAL="neuron-disagg: FATAL:"
STOP="neuron-disagg: STOP:"

# Says why on the console, in the journal and on disk, then powers off.
power_off() {  # $1: FATAL or STOP's prefix, $2: the reason
  local line="$1 $2"
  local console
  echo "$line"
  for console in "$ROOT/dev/console" "$ROOT/dev/ttyS0"; do
    if [[ -w "$console" ]]; then
      echo "$line" > "$console" 2> /dev/null
    fi
  done
  mkdir -p "$STATE" && echo "$(date -u +%FT%TZ) $line" >> "$STATE/powered-off"
  shutdown -h now "$line" || poweroff
  exit 0
}

watch() {
  local once=${1:-}
  if [[ ! -r "$SETTINGS" ]]; then
    power_off "$FATAL" "the guard has no $SETTINGS: the boot script did not finish; see /var/log/neuron-disagg-user-data.log"
  fi
  local SERVE_WITHIN_S="" CHECKS="" STOP_AT="" MAX_HOURS=""
  # shellcheck source=/dev/null
  . "$SETTINGS"
  local boot
  boot=$(awk '$1 == "btime" {print $2}' "$ROOT/proc/stat")
  if [[ ! "$boot" =~ ^[0-9]+$ || ! "$SERVE_WITHIN_S" =~ ^[0-9]+$ ]]; then
    power_off "$FATAL" "the guard cannot tell when this host must serve (boot time '$boot', SERVE_WITHIN_S '$SERVE_WITHIN_S')"
  fi
  local deadline=$((boot + SERVE_WITHIN_S))
  local serving=""  # once every URL has answered this boot, only max_hours is watched
  [[ -e "$SERVED" ]] && serving=yes
  while true; do
    local now
    now=$(date +%s)
    if [[ -n "$STOP_AT" ]] && ((now >= STOP_AT)); then
      power_off "$STOP" "max_hours ($MAX_HOURS) reached: powering off, which terminates this instance"
    fi
    if [[ -z "$serving" ]]; then
      local url silent=()
      for url in $CHECKS; do
        curl -fsS -m 5 -o /dev/null "$url" 2> /dev/null || silent+=("$url")
      done
      if [[ ${#silent[@]} -eq 0 ]]; then
        serving=yes
        mkdir -p "$(dirname "$SERVED")" && touch "$SERVED"
        echo "neuron-disagg-guard: every instance serves ($CHECKS)"
      elif ((now >= deadline)); then
        power_off "$FATAL" "not serving $((SERVE_WITHIN_S / 60)) min after boot: no answer from ${silent[*]}; see journalctl -u 'neuron-disagg-*' on the instance"
      fi
    fi
    [[ -n "$once" ]] && return 0
    sleep "$INTERVAL_S"
  done
}

# A unit systemd gave up restarting: ID is its name as neuron-disagg-fatal@.service's instance,
# e.g. neuron-disagg-prefill-0 for neuron-disagg-prefill@0 (the units name it %p-%i: no second @).
unit_failed() {
  local id=$1 unit last
  if [[ "$id" =~ ^(neuron-disagg-(prefill|decode))-([0-9]+)$ ]]; then
    unit="${BASH_REMATCH[1]}@${BASH_REMATCH[3]}.service"
  else
    unit="$id.service"
  fi
  last=$(journalctl -u "$unit" -n 50 --no-pager -o cat 2> /dev/null | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c 1-240)
  power_off "$FATAL" "$unit kept failing and systemd stopped restarting it${last:+; its last words: $last}"
}

case "${1:-}" in
  watch) watch "${2:-}" ;;
  unit-failed) unit_failed "${2:?unit-failed needs a unit id}" ;;
  *)
    echo "usage: neuron-disagg-guard watch [--once] | unit-failed ID" >&2
    exit 2
    ;;
esac
