//! The service's packaging (issue 20): the systemd unit passes `systemd-analyze verify`
//! (skipped, saying so, where the tool is missing), and the unit, the sample
//! configuration, the Debian package's assets and where `memfold` looks for the agent
//! library agree on every path.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The unit's `KEY=value` lines (the last of each key).
fn unit_value(unit: &str, key: &str) -> String {
    unit.lines()
        .rev()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("the unit has no {key}="))
        .to_owned()
}

/// Where the package puts its AppArmor rules for libvirt's QEMUs (newer libvirt's
/// abstractions/libvirt-qemu includes the folder if it exists).
const APPARMOR_SNIPPET: &str = "/etc/apparmor.d/abstractions/libvirt-qemu.d/memfold";

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let unit = read("packaging/memfoldd.service");
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        memfold_sys::testing::skipped(
            "the_unit_passes_systemd_analyze_verify",
            "systemd-analyze is not installed (Debian: the systemd package)",
        );
        return;
    }
    // verify wants ExecStart's binary to exist: the one this build made.
    let dir = tempfile::tempdir().unwrap();
    let here = unit.replace("/usr/bin/memfoldd", env!("CARGO_BIN_EXE_memfoldd"));
    assert_ne!(here, unit, "the unit starts /usr/bin/memfoldd");
    let path = dir.path().join("memfoldd.service");
    std::fs::write(&path, here).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // verify warns (and still exits 0) on a value it ignores: any output is a failure.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {}\n{said}",
        out.status
    );
}

#[test]
fn the_unit_the_config_and_the_package_agree_on_paths() {
    let unit = read("packaging/memfoldd.service");
    assert_eq!(
        unit_value(&unit, "ExecStart"),
        "/usr/bin/memfoldd --config /etc/memfold/memfoldd.toml"
    );
    assert_eq!(unit_value(&unit, "Type"), "notify");
    assert_eq!(unit_value(&unit, "Restart"), "on-failure");
    // The socket's folder is the unit's runtime directory.
    let runtime = unit_value(&unit, "RuntimeDirectory");
    assert!(
        read("packaging/memfoldd.toml")
            .contains(&format!("# socket = \"/run/{runtime}/memfoldd.sock\"")),
        "the sample's socket is in /run/{runtime}"
    );

    let manifest: toml::Table = read("crates/memfold-cli/Cargo.toml").parse().unwrap();
    let deb = &manifest["package"]["metadata"]["deb"];
    let installed: Vec<(String, String)> = deb["assets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let src = a[0].as_str().unwrap();
            let dest = a[1].as_str().unwrap();
            let name = Path::new(src).file_name().unwrap().to_str().unwrap();
            let to = if dest.ends_with('/') {
                format!("/{dest}{name}")
            } else {
                format!("/{dest}")
            };
            (src.to_owned(), to)
        })
        .collect();
    for (src, _) in &installed {
        if !src.starts_with("target/") {
            let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
            assert!(p.exists(), "the package's asset {src} is missing");
        }
    }
    let has = |to: &str| installed.iter().any(|(_, t)| t == to);
    let agent = memfold_cli::install::agent_library(Path::new("/usr/bin/memfold"));
    let agent_at = memfold_cli::install::agent_library_candidates(Path::new("/usr/bin/memfold"));
    for to in [
        "/usr/bin/memfoldd",
        "/usr/bin/memfold",
        "/lib/systemd/system/memfoldd.service",
        "/etc/memfold/memfoldd.toml",
        APPARMOR_SNIPPET,
    ] {
        assert!(has(to), "the package installs {to}: {installed:?}");
    }
    assert!(
        agent_at.iter().any(|p| has(p.to_str().unwrap())),
        "the package puts the agent library where /usr/bin/memfold looks ({agent_at:?}; found here: {agent:?})"
    );
    let conf = deb["conf-files"].as_array().unwrap();
    assert!(
        conf.iter()
            .any(|c| c.as_str() == Some("/etc/memfold/memfoldd.toml")),
        "the configuration is a conffile"
    );
    assert!(
        conf.iter().any(|c| c.as_str() == Some(APPARMOR_SNIPPET)),
        "the AppArmor rules are a conffile (an operator may add a socket path)"
    );
    // The rules allow what the agent is given by default: the library where the
    // package puts it, memfoldd's default socket.
    let rules = read("packaging/apparmor/libvirt-qemu.memfold");
    for rule in [
        "/usr/lib/memfold/libmemfold_agent.so mr,",
        "/run/memfold/memfoldd.sock rw,",
        "/dev/userfaultfd rw,",
    ] {
        assert!(rules.lines().any(|l| l.trim() == rule), "{rule} missing");
    }
}
