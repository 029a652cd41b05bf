#!/usr/bin/env bash
# Opt-in, as root: write the udev entry cuFile needs on nodes without a udev database (micro-VMs,
# containers). Without it cuFileHandleRegister fails with 5027 even in compatibility mode; the
# library itself then falls back to its POSIX path (tested without this script).
#
#   scripts/cufile-udev.sh [DIR...]      default: the current directory
#
# For the block device holding each DIR (and its parent disk, if a partition) it writes
# /run/udev/data/b<major>:<minor> with E:ID_FS_USAGE=filesystem and E:ID_FS_TYPE=<fs type>.
# Undo: scripts/cufile-udev.sh --remove [DIR...]
set -euo pipefail
remove=0
if [[ "${1:-}" == "--remove" ]]; then remove=1; shift; fi
[[ $# -gt 0 ]] || set -- "$PWD"
[[ $(id -u) -eq 0 ]] || { echo "cufile-udev: must run as root" >&2; exit 1; }
mkdir -p /run/udev/data

entry() { # major minor fstype
  local f="/run/udev/data/b$1:$2"
  if [[ $remove -eq 1 ]]; then rm -f "$f"; echo "removed $f"; return; fi
  if [[ -e "$f" ]] && grep -q '^E:ID_FS_USAGE=' "$f"; then echo "kept $f"; return; fi
  printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$3" >> "$f"
  echo "wrote $f ($3)"
}

for dir in "$@"; do
  src=$(findmnt -n -o SOURCE --target "$dir" | head -1)
  fstype=$(findmnt -n -o FSTYPE --target "$dir" | head -1)
  majmin=$(findmnt -n -o MAJ:MIN --target "$dir" | head -1 | tr -d ' ')
  [[ "$fstype" == ext4 || "$fstype" == xfs ]] || echo "cufile-udev: $dir is on $fstype; cuFile may still refuse it" >&2
  entry "${majmin%%:*}" "${majmin##*:}" "$fstype"
  if [[ -b "$src" ]]; then
    # The brief's way: the device node's major:minor, printed in hex by stat.
    IFS=: read -r hmaj hmin < <(stat -L -c '%t:%T' "$src")
    maj=$((16#$hmaj)); min=$((16#$hmin))
    [[ "$maj:$min" == "$majmin" ]] || entry "$maj" "$min" "$fstype"
    parent=$(lsblk -no PKNAME "$src" 2>/dev/null | head -1 || true)
    if [[ -n "$parent" && -b "/dev/$parent" ]]; then
      IFS=: read -r hmaj hmin < <(stat -L -c '%t:%T' "/dev/$parent")
      entry "$((16#$hmaj))" "$((16#$hmin))" "$fstype"
    fi
  fi
done
