use super::*;

/// What `virt-install` leaves (libosinfo metadata, no memoryBacking, no qemu namespace),
/// as `virsh dumpxml --inactive` prints it.
const PLAIN: &str = r#"<domain type='kvm'>
  <name>web1</name>
  <uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid>
  <metadata>
    <libosinfo:libosinfo xmlns:libosinfo="http://libosinfo.org/xmlns/libvirt/domain/1.0">
      <libosinfo:os id="http://debian.org/debian/12"/>
    </libosinfo:libosinfo>
  </metadata>
  <memory unit='KiB'>2097152</memory>
  <currentMemory unit='KiB'>2097152</currentMemory>
  <vcpu placement='static'>2</vcpu>
  <os>
    <type arch='x86_64' machine='pc-q35-7.2'>hvm</type>
    <boot dev='hd'/>
  </os>
  <features>
    <acpi/>
    <apic/>
  </features>
  <cpu mode='host-passthrough' check='none' migratable='on'/>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' discard='unmap'/>
      <source file='/var/lib/libvirt/images/web1.qcow2'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='network'>
      <mac address='52:54:00:6b:3c:58'/>
      <source network='default'/>
      <model type='virtio'/>
    </interface>
    <graphics type='vnc' port='-1' autoport='yes' passwd='s3cret&amp;more'/>
    <memballoon model='virtio'>
      <address type='pci' domain='0x0000' bus='0x05' slot='0x00' function='0x0'/>
    </memballoon>
  </devices>
</domain>
"#;

/// No metadata, a memoryBacking of its own (nosharepages, locked, file source, private
/// access), a qemu namespace and commandline already there, a comment.
const TUNED: &str = r#"<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>db,1</name>
  <memory unit='MiB'>512</memory>
  <memoryBacking>
    <nosharepages/>
    <locked/>
    <source type='file'/>
    <access mode='private'/>
  </memoryBacking>
  <!-- kept by hand -->
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>/var/lib/libvirt/images/tiny/vmlinuz</kernel>
    <initrd>/var/lib/libvirt/images/tiny/initrd.img</initrd>
    <cmdline>console=ttyS0 panic=-1 quiet</cmdline>
  </os>
  <devices>
    <serial type='file'>
      <source path='/var/log/libvirt/qemu/db-serial.log'/>
    </serial>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-no-reboot'/>
    <qemu:env name='TZ' value='UTC'/>
  </qemu:commandline>
</domain>
"#;

/// Huge pages.
const HUGE: &str = r#"<domain type='kvm'>
  <name>big</name>
  <memory unit='GiB'>16</memory>
  <memoryBacking>
    <hugepages>
      <page size='2048' unit='KiB'/>
    </hugepages>
  </memoryBacking>
  <devices/>
</domain>"#;

/// Two NUMA cells, one private.
const NUMA: &str = r#"<domain type='kvm'>
  <name>numa</name>
  <memory unit='MiB'>1024</memory>
  <cpu>
    <numa>
      <cell id='0' cpus='0' memory='512' unit='MiB'/>
      <cell id='1' cpus='1' memory='512' unit='MiB' memAccess='private'/>
    </numa>
  </cpu>
</domain>"#;

fn settings() -> Settings {
    Settings {
        agent: "/usr/lib/memfold/libmemfold_agent.so".into(),
        socket: "/run/memfold/memfoldd.sock".into(),
        claim_monitor: None,
    }
}

fn claiming() -> Settings {
    Settings {
        claim_monitor: Some("/var/lib/libvirt/qemu/memfold-qmp-web1.sock".into()),
        ..settings()
    }
}

/// enable, then disable, gives back the very text it started from (and so an
/// equivalent XML).
fn round_trip(xml: &str, s: &Settings) -> String {
    let on = enable(xml, s).unwrap();
    assert!(is_enabled(&on.xml).unwrap());
    let off = disable(&on.xml).unwrap().expect("enabled");
    assert_eq!(off, xml, "disable restores the text exactly");
    assert_eq!(canonical(&off).unwrap(), canonical(xml).unwrap());
    assert!(!is_enabled(&off).unwrap());
    on.xml
}

#[test]
fn a_plain_domain_gets_memfd_ram_the_agent_and_a_record() {
    let on = enable(PLAIN, &settings()).unwrap();
    assert_eq!(on.name, "web1");
    assert!(!on.was_enabled);
    let x = &on.xml;
    assert!(
        x.starts_with(&format!("<domain type='kvm' xmlns:qemu=\"{QEMU_NS}\">")),
        "{x}"
    );
    assert!(x.contains(
        "  <currentMemory unit='KiB'>2097152</currentMemory>\n  <memoryBacking>\n    <source type=\"memfd\"/>\n    <access mode=\"shared\"/>\n  </memoryBacking>\n  <vcpu"
    ), "{x}");
    assert!(x.contains(
        "  <qemu:commandline>\n    <qemu:env name=\"LD_PRELOAD\" value=\"/usr/lib/memfold/libmemfold_agent.so\"/>\n    <qemu:env name=\"MEMFOLD_SOCKET\" value=\"/run/memfold/memfoldd.sock\"/>\n    <qemu:env name=\"MEMFOLD_VM_NAME\" value=\"web1\"/>\n  </qemu:commandline>\n</domain>\n"
    ), "{x}");
    // The record sits beside libosinfo's, in <metadata>, which was there.
    assert!(x.contains("    </libosinfo:libosinfo>\n    <memfold:libvirt xmlns:memfold=\"https://memfold.invalid/schemas/libvirt/1\" qemu-namespace=\"added\" memoryBacking=\"added\" commandline=\"added\"/>\n  </metadata>"), "{x}");
    // The rest untouched: the password, its escaping and the quotes as they were.
    assert!(x.contains("passwd='s3cret&amp;more'"));
    assert!(x.contains("<memballoon model='virtio'>"));
    round_trip(PLAIN, &settings());
}

#[test]
fn a_tuned_domain_keeps_its_other_backing_and_commandline() {
    let on = enable(TUNED, &settings()).unwrap();
    assert_eq!(on.name, "db,1");
    let x = &on.xml;
    // The namespace was there: not added again.
    assert_eq!(x.matches("xmlns:qemu").count(), 1);
    assert!(x.contains(
        "  <memoryBacking>\n    <nosharepages/>\n    <locked/>\n    <source type=\"memfd\"/>\n    <access mode=\"shared\"/>\n  </memoryBacking>"
    ), "{x}");
    assert!(
        x.contains("    <qemu:env name='TZ' value='UTC'/>\n    <qemu:env name=\"LD_PRELOAD\""),
        "{x}"
    );
    assert!(x.contains("<qemu:arg value='-no-reboot'/>"));
    assert!(x.contains("<!-- kept by hand -->"));
    // No metadata before: one made, after <name>, holding the original backing.
    assert!(
        x.contains("  <name>db,1</name>\n  <metadata>\n    <memfold:libvirt"),
        "{x}"
    );
    assert!(x.contains("metadata=\"added\""));
    assert!(x.contains("<memfold:original>"));
    assert!(
        x.contains("<source type='file'/>"),
        "the original is kept in the record"
    );
    round_trip(TUNED, &settings());
}

/// What the operator changed in `<memoryBacking>` between enable and disable stays:
/// disable puts back only `<source>` and `<access>` as they were (it put back the whole
/// original element, or removed the one it had added, with the operator's children).
#[test]
fn disable_keeps_what_the_operator_changed_in_the_backing_since() {
    // Added by enable; the operator then locks the guest's memory.
    let on = enable(PLAIN, &settings()).unwrap();
    let edited = on.xml.replace(
        "    <access mode=\"shared\"/>\n",
        "    <access mode=\"shared\"/>\n    <locked/>\n",
    );
    assert_ne!(edited, on.xml);
    let off = disable(&edited).unwrap().expect("enabled");
    assert!(
        off.contains("  <memoryBacking>\n    <locked/>\n  </memoryBacking>"),
        "{off}"
    );
    assert!(!off.contains("memfd") && !off.contains("<access"), "{off}");
    // The domain's own; the operator drops `<nosharepages/>` and adds `<discard/>`.
    let on = enable(TUNED, &settings()).unwrap();
    let edited = on
        .xml
        .replace("    <nosharepages/>\n", "")
        .replace("    <locked/>\n", "    <locked/>\n    <discard/>\n");
    let off = disable(&edited).unwrap().expect("enabled");
    assert!(
        off.contains("  <memoryBacking>\n    <locked/>\n    <discard/>\n    <source type='file'/>\n    <access mode='private'/>\n  </memoryBacking>"),
        "{off}"
    );
}

#[test]
fn huge_pages_and_private_numa_cells_are_refused_and_nothing_changes() {
    match enable(HUGE, &settings()) {
        Err(e @ XmlError::Hugepages { .. }) => {
            let m = e.to_string();
            assert!(m.contains("domain big") && m.contains("<hugepages>"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    match enable(NUMA, &settings()) {
        Err(XmlError::PrivateCell { cell, access, .. }) => {
            assert_eq!((cell.as_str(), access.as_str()), ("1", "private"));
        }
        other => panic!("{other:?}"),
    }
    let shared = NUMA.replace(" memAccess='private'", " memAccess='shared'");
    round_trip(&shared, &settings());
}

/// `PLAIN` with `devices` added before its `<memballoon>`.
fn with_devices(devices: &str) -> String {
    PLAIN.replace("    <memballoon", &format!("{devices}\n    <memballoon"))
}

/// Devices and disks the agent would leave the guest alone for (what libvirt makes of
/// them is in `RamPlan::outside_writers` / `unfenced_io`) are refused, each named, and
/// nothing changes; their harmless kin pass.
#[test]
fn devices_the_agent_would_refuse_are_refused_and_nothing_changes() {
    for (device, says) in [
        (
            "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></source></hostdev>",
            "<hostdev type='pci'> 0000:01:00.0 (VFIO)",
        ),
        (
            "<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='c2177883-f1bb-47f0-914d-32a22e3a8804'/></source></hostdev>",
            "<hostdev type='mdev'> c2177883-f1bb-47f0-914d-32a22e3a8804 (VFIO)",
        ),
        (
            "<interface type='hostdev' managed='yes'><mac address='52:54:00:6d:90:02'/><source><address type='pci' domain='0x0000' bus='0x02' slot='0x07' function='0x0'/></source></interface>",
            "<interface type='hostdev'> 52:54:00:6d:90:02 (VFIO)",
        ),
        (
            "<filesystem type='mount' accessmode='passthrough'><driver type='virtiofs'/><source dir='/srv/share'/><target dir='share'/></filesystem>",
            "<filesystem> share with <driver type='virtiofs'/>",
        ),
        (
            "<interface type='vhostuser'><mac address='52:54:00:3b:83:1a'/><source type='unix' path='/tmp/vhost1.sock' mode='server'/><model type='virtio'/></interface>",
            "<interface type='vhostuser'> 52:54:00:3b:83:1a",
        ),
        (
            "<interface type='vdpa'><source dev='/dev/vhost-vdpa-0'/></interface>",
            "<interface type='vdpa'>",
        ),
        (
            "<video><model type='virtio'/><driver name='vhostuser'/></video>",
            "<video> with <driver name='vhostuser'/>",
        ),
        (
            "<disk type='nvme' device='disk'><driver name='qemu' type='raw'/><source type='pci' managed='yes' namespace='1'><address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></source><target dev='vde' bus='virtio'/></disk>",
            "<disk type='nvme'> vde (VFIO)",
        ),
    ] {
        match enable(&with_devices(device), &settings()) {
            Err(e @ XmlError::OutsideWriters { .. }) => {
                let m = e.to_string();
                assert!(m.starts_with(&format!("domain web1: {says}: such a device's back end writes guest RAM outside QEMU's page tables")), "{m}");
            }
            other => panic!("{device}: {other:?}"),
        }
    }
    let disk = |driver: &str| {
        PLAIN.replace(
            "<driver name='qemu' type='qcow2' discard='unmap'/>",
            &format!("<driver name='qemu' type='qcow2' {driver}/>"),
        )
    };
    for (driver, says) in [
        ("io='native'", "<disk> vda with <driver io='native'/>"),
        (
            "cache='none' io='native'",
            "<disk> vda with <driver io='native'/>",
        ),
        (
            "cache='none' io='io_uring'",
            "<disk> vda with <driver io='io_uring' cache='none'/>",
        ),
        (
            "io='io_uring' cache='directsync'",
            "<disk> vda with <driver io='io_uring' cache='directsync'/>",
        ),
    ] {
        match enable(&disk(driver), &settings()) {
            Err(e @ XmlError::UnfencedDisks { .. }) => {
                let m = e.to_string();
                assert!(
                    m.starts_with(&format!("domain web1: {says}: QEMU reads such a disk")),
                    "{m}"
                );
                assert!(m.contains("drop the io attribute"), "{m}");
            }
            other => panic!("{driver}: {other:?}"),
        }
    }
    // Several at once: each is named.
    let two = with_devices(
        "<hostdev mode='subsystem' type='pci'><source><address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></source></hostdev>\n<interface type='vdpa'><source dev='/dev/vhost-vdpa-0'/></interface>",
    );
    assert!(matches!(
        enable(&two, &settings()),
        Err(XmlError::OutsideWriters { devices, .. }) if devices.len() == 2
    ));
    // What the agent manages: buffered io_uring, threads, USB and SCSI host devices
    // (QEMU's own), a 9p share, memfold-blk's vhost-user disk, a plain virtio GPU.
    for fine in [
        disk("cache='writeback' io='io_uring'"),
        disk("cache='none' io='threads'"),
        disk("cache='none'"),
        with_devices("<hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/><product id='0xbeef'/></source></hostdev>"),
        with_devices("<hostdev mode='subsystem' type='scsi_host'><source protocol='vhost' wwpn='naa.5001405df3e54061'/></hostdev>"),
        with_devices("<filesystem type='mount' accessmode='mapped'><source dir='/srv'/><target dir='srv'/></filesystem>"),
        with_devices("<disk type='vhostuser' device='disk'><driver name='qemu' type='raw'/><source type='unix' path='/run/blk.sock'/><target dev='vdb' bus='virtio'/></disk>"),
        with_devices("<video><model type='virtio'/></video>"),
    ] {
        round_trip(&fine, &settings());
    }
}

#[test]
fn enable_is_idempotent_and_takes_new_settings() {
    for xml in [PLAIN, TUNED] {
        let once = enable(xml, &settings()).unwrap();
        let twice = enable(&once.xml, &settings()).unwrap();
        assert!(twice.was_enabled);
        assert_eq!(twice.xml, once.xml);
        let moved = enable(
            &once.xml,
            &Settings {
                socket: "/srv/memfold.sock".into(),
                ..settings()
            },
        )
        .unwrap();
        assert!(moved.xml.contains("value=\"/srv/memfold.sock\""));
        assert!(!moved.xml.contains("/run/memfold/memfoldd.sock"));
        assert_eq!(moved.xml.matches("MEMFOLD_SOCKET").count(), 1);
        assert_eq!(disable(&moved.xml).unwrap().unwrap(), xml);
    }
}

#[test]
fn disable_on_a_domain_memfold_never_touched_does_nothing() {
    assert_eq!(disable(PLAIN).unwrap(), None);
    assert_eq!(disable(TUNED).unwrap(), None);
}

#[test]
fn claim_adds_the_monitor_and_disable_takes_it_away() {
    let x = round_trip(PLAIN, &claiming());
    assert!(x.contains(
        "    <qemu:arg value=\"-chardev\"/>\n    <qemu:arg value=\"socket,id=memfold-qmp,path=/var/lib/libvirt/qemu/memfold-qmp-web1.sock,server=on,wait=off\"/>\n    <qemu:arg value=\"-mon\"/>\n    <qemu:arg value=\"chardev=memfold-qmp,mode=control\"/>\n    <qemu:env name=\"LD_PRELOAD\""
    ), "{x}");
    // A comma in the path is doubled, as QEMU's options want.
    assert_eq!(
        monitor_chardev("/a,b.sock"),
        "socket,id=memfold-qmp,path=/a,,b.sock,server=on,wait=off"
    );
    let s = Settings {
        claim_monitor: Some("/var/lib/libvirt/qemu/memfold-qmp-db,,1.sock".into()),
        ..settings()
    };
    round_trip(TUNED, &s);
    // No balloon, no claim.
    let none = PLAIN.replace("<memballoon model='virtio'>", "<memballoon model='none'>");
    assert!(matches!(
        enable(&none, &claiming()),
        Err(XmlError::NoBalloon { model, .. }) if model == "none"
    ));
    round_trip(&none, &settings());
}

#[test]
fn someone_elses_preload_is_not_overwritten() {
    let x = TUNED.replace(
        "<qemu:env name='TZ' value='UTC'/>",
        "<qemu:env name='LD_PRELOAD' value='/opt/trace.so'/>",
    );
    match enable(&x, &settings()) {
        Err(e @ XmlError::EnvConflict { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("LD_PRELOAD='/opt/trace.so'") && m.contains("db,1"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_user_arg_that_looks_like_ours_stays() {
    // The operator's own -mon for another chardev, and a -chardev of theirs: not ours.
    let x = TUNED.replace(
        "<qemu:arg value='-no-reboot'/>",
        "<qemu:arg value='-chardev'/>\n    <qemu:arg value='socket,id=mine,path=/tmp/m.sock,server=on,wait=off'/>\n    <qemu:arg value='-mon'/>\n    <qemu:arg value='chardev=mine,mode=control'/>",
    );
    round_trip(&x, &claiming());
}

#[test]
fn empty_and_compact_documents() {
    // One line, an empty memoryBacking, an XML declaration and a trailing comment.
    let x = "<?xml version=\"1.0\"?>\n<domain type='qemu'><name>c</name><memory>1</memory><memoryBacking/></domain>\n<!-- end -->\n";
    let on = round_trip(x, &settings());
    assert!(
        on.contains("<memoryBacking>\n    <source type=\"memfd\"/>"),
        "{on}"
    );
    assert!(on.ends_with("</domain>\n<!-- end -->\n"));
    // A name with markup in it is read unescaped.
    let amp = PLAIN.replace("<name>web1</name>", "<name>a&amp;b</name>");
    let on = enable(&amp, &settings()).unwrap();
    assert_eq!(on.name, "a&b");
    assert!(on
        .xml
        .contains("name=\"MEMFOLD_VM_NAME\" value=\"a&amp;b\""));
}

#[test]
fn bad_input_is_named() {
    assert!(matches!(
        enable("<domain><name>x</domain>", &settings()),
        Err(XmlError::Parse { .. })
    ));
    assert!(
        matches!(enable("<network><name>x</name></network>", &settings()), Err(XmlError::NotADomain(n)) if n == "network")
    );
    assert!(matches!(
        enable(
            "<domain type='kvm'><memory>1</memory></domain>",
            &settings()
        ),
        Err(XmlError::NoName)
    ));
    // A record without the memoryBacking it must restore.
    let on = enable(TUNED, &settings()).unwrap().xml;
    let start = on.find("<memfold:original>").unwrap();
    let end = on.find("</memfold:original>").unwrap() + "</memfold:original>".len();
    let damaged = format!("{}{}", &on[..start], &on[end..]);
    assert!(matches!(disable(&damaged), Err(XmlError::BadRecord(_))));
}

#[test]
fn canonical_reads_libvirts_style_as_ours() {
    // What libvirt gives back for an enabled domain: its quotes, its attribute order.
    let on = enable(PLAIN, &settings()).unwrap().xml;
    let libvirt_style = on
        .replace('"', "'")
        .replace(
            "<graphics type='vnc' port='-1' autoport='yes' passwd='s3cret&amp;more'/>",
            "<graphics passwd='s3cret&amp;more' type='vnc' port='-1' autoport='yes'/>",
        )
        .replace("  </metadata>", "\n  </metadata>");
    assert_ne!(libvirt_style, on);
    assert_eq!(canonical(&libvirt_style).unwrap(), canonical(&on).unwrap());
    let again = enable(&libvirt_style, &settings()).unwrap();
    assert!(again.was_enabled);
    assert_eq!(canonical(&again.xml).unwrap(), canonical(&on).unwrap());
    // A changed value is a difference.
    let other = on.replace("/run/memfold/memfoldd.sock", "/run/other.sock");
    assert_ne!(canonical(&other).unwrap(), canonical(&on).unwrap());
}

#[test]
fn an_attribute_is_removed_whatever_its_quotes() {
    let ns = QEMU_NS;
    for (raw, want) in [
        (
            format!("domain type='kvm' xmlns:qemu='{ns}'"),
            "domain type='kvm'",
        ),
        (
            format!("domain xmlns:qemu=\"{ns}\" type='kvm'"),
            "domain type='kvm'",
        ),
        (
            format!("domain\n  xmlns:qemu = '{ns}'\n  id='1'"),
            "domain\n  id='1'",
        ),
        // Another attribute whose name ends alike stays.
        (
            "domain a-xmlns:qemu='x' type='kvm'".to_string(),
            "domain a-xmlns:qemu='x' type='kvm'",
        ),
    ] {
        assert_eq!(without_attr(&raw, "xmlns:qemu"), want, "{raw}");
    }
}
