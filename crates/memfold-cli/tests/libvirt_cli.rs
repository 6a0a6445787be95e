//! `memfold libvirt enable|disable` against a stand-in `virsh` (a shell script on PATH
//! that keeps one domain's XML in a file and logs its arguments): the commands virsh is
//! given, `--connect` passed through, idempotence, the running-domain note, the exact
//! restore, refusals that define nothing, and socket paths as libvirt's QEMU (in `/`)
//! needs them. The real libvirt: scripts/libvirt-check.sh.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

const DOMAIN: &str = "<domain type='kvm'>
  <name>web1</name>
  <uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid>
  <memory unit='KiB'>524288</memory>
  <currentMemory unit='KiB'>524288</currentMemory>
  <vcpu placement='static'>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>
  </os>
  <devices>
    <graphics type='vnc' port='-1' autoport='yes' passwd='hunter2'/>
    <memballoon model='virtio'/>
  </devices>
</domain>
";

/// A folder with the fake virsh, the domain's XML and its state.
fn fake_virsh(xml: &str, state: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("domain.xml"), xml).unwrap();
    std::fs::write(d.join("state"), format!("{state}\n")).unwrap();
    let script = format!(
        r#"#!/bin/sh
d={dir}
echo "$*" >> $d/calls
if [ "$1" = --connect ]; then shift 2; fi
case "$1" in
  dumpxml) [ "$2 $3" = "--inactive --security-info" ] && [ "$4" = web1 ] || {{ echo "error: failed to get domain '$4'" >&2; exit 1; }}; cat $d/domain.xml ;;
  define) cp "$2" $d/domain.xml; echo "Domain 'web1' defined from $2" ;;
  domstate) cat $d/state ;;
  dominfo) echo "Name:           web1"; echo "Persistent:     $(cat $d/persistent 2>/dev/null || echo yes)" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
"#,
        dir = d.display()
    );
    let virsh = d.join("virsh");
    std::fs::write(&virsh, script).unwrap();
    std::fs::set_permissions(&virsh, std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent = d.join("libmemfold_agent.so");
    std::fs::write(&agent, b"").unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o644)).unwrap();
    dir
}

fn memfold(dir: &Path, args: &[&str]) -> Output {
    memfold_in(dir, Path::new("/"), args)
}

/// As [`memfold`], run in the folder `cwd`.
fn memfold_in(dir: &Path, cwd: &Path, args: &[&str]) -> Output {
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new(env!("CARGO_BIN_EXE_memfold"))
        .arg("libvirt")
        .args(args)
        .env("PATH", path)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn enable_then_disable_through_virsh() {
    let dir = fake_virsh(DOMAIN, "running");
    let d = dir.path();
    let agent = d.join("libmemfold_agent.so");
    let agent = agent.to_str().unwrap();
    let xml = || std::fs::read_to_string(d.join("domain.xml")).unwrap();

    let o = memfold(
        d,
        &[
            "enable",
            "web1",
            "--connect",
            "qemu:///system",
            "--agent",
            agent,
        ],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("web1: enabled memfold"), "{t}");
    assert!(
        t.contains("applies at its next start"),
        "a running domain is told: {t}"
    );
    let on = xml();
    assert!(
        on.contains(&format!(
            "<qemu:env name=\"LD_PRELOAD\" value=\"{agent}\"/>"
        )),
        "{on}"
    );
    assert!(on.contains("<source type=\"memfd\"/>"));
    assert!(
        on.contains("passwd='hunter2'"),
        "--security-info: the password is kept"
    );
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert!(
        calls
            .lines()
            .all(|l| l.starts_with("--connect qemu:///system ")),
        "--connect on every call: {calls}"
    );
    assert!(calls.contains("dumpxml --inactive --security-info web1"));
    // The temporary file define read is gone.
    let defined = calls
        .lines()
        .find_map(|l| l.strip_prefix("--connect qemu:///system define "))
        .unwrap();
    assert!(!Path::new(defined).exists(), "{defined} left behind");

    // Again: nothing to define.
    let o = memfold(
        d,
        &["enable", "web1", "-c", "qemu:///system", "--agent", agent],
    );
    assert!(
        text(&o).contains("enabled already, with these settings; nothing to change"),
        "{}",
        text(&o)
    );
    assert_eq!(xml(), on);
    let defines = |c: &str| c.lines().filter(|l| l.contains(" define ")).count();
    assert_eq!(
        defines(&std::fs::read_to_string(d.join("calls")).unwrap()),
        1
    );

    std::fs::write(d.join("state"), "shut off\n").unwrap();
    let o = memfold(d, &["disable", "web1", "--connect", "qemu:///system"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(!t.contains("next start"), "a stopped domain: {t}");
    assert_eq!(xml(), DOMAIN, "disable restores the definition");
    let o = memfold(d, &["disable", "web1"]);
    assert!(
        o.status.success() && text(&o).contains("not enabled"),
        "{}",
        text(&o)
    );
}

#[test]
fn refusals_define_nothing_and_say_why() {
    let huge = DOMAIN.replace(
        "  <vcpu",
        "  <memoryBacking>\n    <hugepages/>\n  </memoryBacking>\n  <vcpu",
    );
    let dir = fake_virsh(&huge, "shut off");
    let d = dir.path();
    let agent = d.join("libmemfold_agent.so");
    let o = memfold(d, &["enable", "web1", "--agent", agent.to_str().unwrap()]);
    let t = text(&o);
    assert!(!o.status.success());
    assert!(
        t.contains("domain web1") && t.contains("<hugepages>"),
        "{t}"
    );
    assert_eq!(std::fs::read_to_string(d.join("domain.xml")).unwrap(), huge);
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert!(!calls.contains("define"), "{calls}");

    // What the agent would leave unmanaged: a VFIO device, a disk read beyond the fence.
    for (device, says) in [
        (
            "    <hostdev mode='subsystem' type='pci' managed='yes'>\n      <source><address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></source>\n    </hostdev>\n",
            "domain web1: <hostdev type='pci'> 0000:01:00.0 (VFIO): such a device's back end writes guest RAM outside QEMU's page tables",
        ),
        (
            "    <disk type='file' device='disk'>\n      <driver name='qemu' type='raw' cache='none' io='native'/>\n      <source file='/v/d.img'/>\n      <target dev='vda' bus='virtio'/>\n    </disk>\n",
            "domain web1: <disk> vda with <driver io='native'/>: QEMU reads such a disk into guest RAM after the submitting call returns",
        ),
    ] {
        let xml = DOMAIN.replace("    <memballoon", &format!("{device}    <memballoon"));
        std::fs::write(d.join("domain.xml"), &xml).unwrap();
        let o = memfold(d, &["enable", "web1", "--agent", agent.to_str().unwrap()]);
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(t.contains(says), "{t}");
        assert_eq!(std::fs::read_to_string(d.join("domain.xml")).unwrap(), xml);
        let calls = std::fs::read_to_string(d.join("calls")).unwrap();
        assert!(!calls.contains("define"), "{calls}");
    }

    // A transient domain (virsh create): defining it would make it persistent.
    std::fs::write(d.join("domain.xml"), DOMAIN).unwrap();
    std::fs::write(d.join("persistent"), "no\n").unwrap();
    let o = memfold(d, &["enable", "web1", "--agent", agent.to_str().unwrap()]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("domain web1 is transient"), "{t}");
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert!(!calls.contains("define"), "{calls}");
    std::fs::remove_file(d.join("persistent")).unwrap();

    // A monitor socket too long for a Unix socket: refused before anything is defined.
    std::fs::write(d.join("domain.xml"), DOMAIN).unwrap();
    let long = format!("/{}", "m".repeat(107));
    let o = memfold(
        d,
        &[
            "enable",
            "web1",
            "--agent",
            agent.to_str().unwrap(),
            "--claim",
            "--monitor-socket",
            &long,
        ],
    );
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains(&format!(
            "--monitor-socket {long}: 108 bytes, but a Unix socket's path must be under 108 bytes"
        )),
        "{t}"
    );
    assert_eq!(
        std::fs::read_to_string(d.join("domain.xml")).unwrap(),
        DOMAIN
    );
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert!(!calls.contains("define"), "{calls}");

    // virsh's own error, with what was asked.
    let o = memfold(d, &["enable", "nosuch", "--agent", agent.to_str().unwrap()]);
    let t = text(&o);
    assert!(!o.status.success());
    assert!(
        t.contains("virsh dumpxml --inactive --security-info nosuch failed")
            && t.contains("failed to get domain 'nosuch'"),
        "{t}"
    );
    // An agent others cannot read (libvirt's QEMU runs as its own user): a warning.
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(d.join("domain.xml"), DOMAIN).unwrap();
    let o = memfold(d, &["enable", "web1", "--agent", agent.to_str().unwrap()]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("is not readable by others (mode 600)"), "{t}");
}

/// libvirt's QEMU runs in `/`: relative `--socket` and `--monitor-socket` paths go into the
/// domain absolute, and the default monitor path of a domain whose name is too long for a
/// Unix socket takes its UUID.
#[test]
fn socket_paths_are_ones_libvirts_qemu_can_use() {
    let dir = fake_virsh(DOMAIN, "shut off");
    let d = dir.path();
    let real = d.canonicalize().unwrap();
    let agent = d.join("libmemfold_agent.so");
    let agent = agent.to_str().unwrap();
    let xml = || std::fs::read_to_string(d.join("domain.xml")).unwrap();
    let o = memfold_in(
        d,
        d,
        &[
            "enable",
            "web1",
            "--agent",
            agent,
            "--socket",
            "run/memfoldd.sock",
            "--claim",
            "--monitor-socket",
            "q.sock",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let on = xml();
    let socket = real.join("run/memfoldd.sock");
    assert!(
        on.contains(&format!(
            "<qemu:env name=\"MEMFOLD_SOCKET\" value=\"{}\"/>",
            socket.display()
        )),
        "{on}"
    );
    assert!(
        on.contains(&format!(
            "path={},server=on,wait=off",
            real.join("q.sock").display()
        )),
        "{on}"
    );
    assert!(text(&o).contains(&format!("MEMFOLD_SOCKET={}", socket.display())));

    // A 70-character name would make the default path 109 bytes.
    let name = "n".repeat(70);
    let long = DOMAIN.replace("<name>web1</name>", &format!("<name>{name}</name>"));
    std::fs::write(d.join("domain.xml"), &long).unwrap();
    let o = memfold(d, &["enable", "web1", "--agent", agent, "--claim"]);
    assert!(o.status.success(), "{}", text(&o));
    let monitor = "/var/lib/libvirt/qemu/memfold-qmp-4dea22b3-1d52-d8f3-2516-782e98ab3fa0.sock";
    let on = xml();
    assert!(on.contains(&format!("path={monitor},")), "{on}");
    assert!(!on.contains(&format!("memfold-qmp-{name}")), "{on}");
    assert!(text(&o).contains(&format!("a QMP monitor for memfoldd at {monitor}")));
    let o = memfold(d, &["disable", "web1"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(xml(), long, "disable finds the monitor by its record");
}
