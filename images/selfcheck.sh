#!/bin/sh
# Self-checking workload: data with known checksums in RAM (tmpfs) and on disk, verified
# in a loop: random files, and zeros, text and near-copies that every memfold mechanism
# takes (memfold-mechanism-data). Any mismatch is printed as MEMFOLD-MISMATCH on the console.
mkdir -p /tmp/check /var/tmp/check
i=0
while [ $i -lt 4 ]; do
    head -c 2097152 /dev/urandom > /tmp/check/r$i
    md5sum /tmp/check/r$i > /tmp/check/r$i.md5
    cp /tmp/check/r$i /var/tmp/check/r$i && md5sum /var/tmp/check/r$i > /var/tmp/check/r$i.md5
    i=$((i + 1))
done
# Zeros, text and near-copies: data every mechanism takes (see the script).
. /usr/local/bin/memfold-mechanism-data > /dev/console
n=0
while true; do
    cold=
    [ $((n % 4)) -eq 3 ] && cold=/tmp/check/cold/*.md5
    for f in /tmp/check/*.md5 /var/tmp/check/*.md5 $cold; do
        md5sum -c --status "$f" || echo "MEMFOLD-MISMATCH $f" > /dev/console
    done
    n=$((n + 1))
    [ -n "$cold" ] && echo "MEMFOLD-COLD-CHECK ok $n" > /dev/console
    [ $((n % 30)) -eq 0 ] && echo "MEMFOLD-CHECK ok $n" > /dev/console
    sleep 2
done
