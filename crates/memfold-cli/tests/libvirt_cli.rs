//! `memfold libvirt enable|disable` against a stand-in `virsh` (a shell script on PATH
//! that keeps one domain's XML in a file and logs its arguments): the commands virsh is
//! given, `--connect` passed through, idempotence, the running-domain note, the exact
//! restore, and a refusal that defines nothing. The real libvirt: scripts/libvirt-check.sh.

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
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new(env!("CARGO_BIN_EXE_memfold"))
        .arg("libvirt")
        .args(args)
        .env("PATH", path)
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
