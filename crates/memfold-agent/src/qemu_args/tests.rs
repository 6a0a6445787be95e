//! `RamPlan::parse` on command lines as QEMU, libvirt and operators write them.

use super::*;

fn plan(line: &str) -> RamPlan {
    let words: Vec<&str> = line.split_whitespace().collect();
    RamPlan::parse(&words).unwrap()
}

#[test]
fn drives_whose_reads_land_after_their_call_are_named() {
    assert!(
        plan("-drive file=a.img,if=virtio -drive file=b,cache=none,aio=threads")
            .unfenced_io
            .is_empty()
    );
    assert!(
        plan("-drive file=b,aio=io_uring").unfenced_io.is_empty(),
        "buffered"
    );
    let p = plan("-drive file=b,cache=none,aio=native -drive file=c,cache.direct=on,aio=io_uring");
    assert_eq!(
        p.unfenced_io,
        [
            "-drive file=b,cache=none,aio=native",
            "-drive file=c,cache.direct=on,aio=io_uring"
        ]
    );
    let libvirt = [
        "-blockdev",
        r#"{"driver":"file","filename":"/v/d.qcow2","node-name":"f","aio":"io_uring","cache":{"direct":true,"no-flush":false}}"#,
    ];
    assert_eq!(RamPlan::parse(&libvirt).unwrap().unfenced_io.len(), 1);
    // Options of a child node: keyval's dotted keys and nested JSON alike.
    assert_eq!(
        plan("-blockdev driver=qcow2,node-name=q,file.driver=file,file.filename=d,file.aio=native")
            .unfenced_io
            .len(),
        1
    );
    let nested = [
        "-blockdev",
        r#"{"driver":"qcow2","node-name":"q","file":{"driver":"file","filename":"d","aio":"io_uring","cache":{"direct":true}}}"#,
    ];
    assert_eq!(RamPlan::parse(&nested).unwrap().unfenced_io.len(), 1);
    let buffered = [
        "-blockdev",
        r#"{"driver":"qcow2","node-name":"q","file":{"driver":"file","filename":"d","aio":"io_uring"}}"#,
    ];
    assert!(RamPlan::parse(&buffered).unwrap().unfenced_io.is_empty());
}

/// Back ends that write guest RAM outside QEMU's page tables are named, in every
/// spelling (keyval, JSON as libvirt writes it, `-nic`); memfold-blk's
/// `vhost-user-blk` and the kernel's vhost-net (it writes through QEMU's page tables)
/// are not.
#[test]
fn back_ends_that_write_guest_ram_outside_qemu_are_named() {
    let fine = plan(
        "-chardev socket,id=blk-root,path=/r/blk.sock -device vhost-user-blk-pci,chardev=blk-root \
         -netdev tap,id=n0,vhost=on -device virtio-net-pci,netdev=n0 -nic user,model=virtio",
    );
    assert!(
        fine.outside_writers.is_empty(),
        "{:?}",
        fine.outside_writers
    );
    let p = plan(
        "-device vhost-user-fs-pci,chardev=fs0,tag=share -netdev vhost-user,id=n1,chardev=c1 \
         -device vfio-pci,host=0000:01:00.0 -nic vhost-vdpa,vhostdev=/dev/vhost-vdpa-0 \
         -device vhost-user-gpu-pci,chardev=g",
    );
    assert_eq!(
        p.outside_writers,
        [
            "-device vhost-user-fs-pci,chardev=fs0,tag=share",
            "-netdev vhost-user,id=n1,chardev=c1",
            "-device vfio-pci,host=0000:01:00.0",
            "-nic vhost-vdpa,vhostdev=/dev/vhost-vdpa-0",
            "-device vhost-user-gpu-pci,chardev=g",
        ]
    );
    // QEMU's VFIO NVMe driver, in each spelling.
    for nvme in [
        "-drive file=nvme://0000:01:00.0/1,if=virtio",
        "-blockdev driver=nvme,node-name=n0,device=0000:01:00.0,namespace=1",
        "-blockdev driver=qcow2,node-name=q,file.driver=nvme,file.device=0000:01:00.0",
    ] {
        assert_eq!(plan(nvme).outside_writers, [nvme], "{nvme}");
    }
    let libvirt = [
        "-device",
        r#"{"driver":"vhost-user-fs-pci","id":"fs0","chardev":"chr-vu-fs0","tag":"mount_tag"}"#,
        "-netdev",
        r#"{"type":"vhost-user","chardev":"charnet0","id":"hostnet0"}"#,
    ];
    assert_eq!(RamPlan::parse(&libvirt).unwrap().outside_writers.len(), 2);
}

fn problems(line: &str) -> Vec<String> {
    plan(line)
        .problems()
        .iter()
        .map(|p| p.to_string())
        .collect()
}

#[test]
fn shared_memfd_ram_is_accepted_in_every_way_qemu_takes_it() {
    for good in [
        // The launcher's line.
        "-object memory-backend-memfd,id=ram0,size=512M,share=on -machine q35,memory-backend=ram0 -m 512M",
        // share is on by default for a memfd backend; -M and --object spellings.
        "--object memory-backend-memfd,id=r,size=1G -M pc,memory-backend=r -m 1G",
        // Two NUMA nodes, each its own backend.
        "-object memory-backend-memfd,id=m0,size=128M,share=on -object memory-backend-memfd,id=m1,size=64M -m 192M -numa node,memdev=m0 -numa node,memdev=m1",
        // A pc-dimm and a virtio-mem device on memfd backends too.
        "-object memory-backend-memfd,id=ram0,size=256M -machine memory-backend=ram0 -m 256M,slots=2,maxmem=1G -object memory-backend-memfd,id=d1,size=256M -device pc-dimm,id=dimm1,memdev=d1 -object memory-backend-memfd,id=vm0,size=512M -device virtio-mem-pci,id=vmem0,memdev=vm0",
        // libvirt's JSON objects.
        r#"-object {"qom-type":"memory-backend-memfd","id":"pc.ram","size":536870912,"share":true} -machine pc-q35-7.2,memory-backend=pc.ram"#,
    ] {
        let p = plan(good);
        assert_eq!(p.problems(), vec![], "{good}");
        assert!(p.any_shareable_ram(), "{good}");
    }
    let p = plan("-object memory-backend-memfd,id=m0,size=128M,share=on -object memory-backend-memfd,id=m1,size=64M -numa node,memdev=m0 -numa node,memdev=m1");
    assert_eq!(p.shareable_backends(), 2);
    assert_eq!(
        p.used,
        vec![("m0".into(), "numa".into()), ("m1".into(), "numa".into())]
    );
}

#[test]
fn ram_memfold_cannot_read_is_refused_with_the_exact_fix() {
    assert_eq!(
        problems("-machine q35 -m 512M -kernel /k"),
        ["guest RAM is QEMU's anonymous memory (-m 512M without a memory backend); add `-object memory-backend-memfd,id=ram0,size=512M,share=on -machine memory-backend=ram0`"]
    );
    // No -m at all: QEMU's 128 MiB; -m size=... form.
    assert!(problems("-nodefaults")[0].contains("size=128M,share=on"));
    assert!(problems("-m size=2G,slots=4,maxmem=8G")[0].contains("size=2G,share=on"));
    // A size without a unit is MiB to -m but bytes to a backend: the fix says MiB.
    assert_eq!(
        problems("-m 256"),
        ["guest RAM is QEMU's anonymous memory (-m 256M without a memory backend); add `-object memory-backend-memfd,id=ram0,size=256M,share=on -machine memory-backend=ram0`"]
    );
    assert!(problems("-m size=4096,slots=2,maxmem=8G")[0].contains("size=4096M,share=on"));
    assert!(problems("-m 1024 -mem-path /hp")[0].contains("size=1024M,share=on"));
    for (m, size) in [
        ("4G", "4G"),
        ("512M", "512M"),
        ("512m", "512m"),
        ("4096B", "4096B"),
    ] {
        assert_eq!(backend_size(m), size);
    }
    assert_eq!(backend_size("1.5"), "1.5M");
    assert!(problems("-m 1G -mem-path /dev/hugepages")[0]
        .starts_with("guest RAM is the file /dev/hugepages (-mem-path)"));
    assert_eq!(
        problems("-object memory-backend-memfd,id=ram0,size=1G,share=off -machine memory-backend=ram0"),
        ["memory backend ram0 is a private memfd (share=off); define it as `-object memory-backend-memfd,id=ram0,size=1G,share=on`"]
    );
    assert_eq!(
        problems("-object memory-backend-ram,id=ram0,size=1G -machine q35,memory-backend=ram0"),
        ["memory backend ram0 is memory-backend-ram (not a memfd); define it as `-object memory-backend-memfd,id=ram0,size=1G,share=on`"]
    );
    assert!(problems(
        "-object memory-backend-file,id=m0,size=1G,mem-path=/dev/shm/g,share=on -numa node,memdev=m0"
    )[0]
        .contains("memory-backend-file (not a memfd)"));
    assert!(problems(
        "-object memory-backend-memfd,id=ram0,size=2G,hugetlb=on,hugetlbsize=2M -machine memory-backend=ram0"
    )[0]
        .contains("hugetlb=on"));
    assert_eq!(
        problems("-machine memory-backend=nope"),
        ["machine names memory backend nope, which no -object defines; add `-object memory-backend-memfd,id=nope,size=SIZE,share=on`"]
    );
    // One good node and one bad: only the bad one is named, and some RAM is shareable.
    let p = plan("-object memory-backend-memfd,id=m0,size=128M -object memory-backend-ram,id=m1,size=64M -numa node,memdev=m0 -numa node,memdev=m1");
    assert_eq!(p.problems().len(), 1);
    assert!(p.problems()[0].to_string().starts_with("memory backend m1"));
    assert!(p.any_shareable_ram());
    // A memfd defined but never used as RAM does not make -m's RAM shareable.
    let p = plan("-object memory-backend-memfd,id=m0,size=128M -m 128M");
    assert!(!p.any_shareable_ram());
    assert!(matches!(p.problems()[..], [Problem::AnonymousRam { .. }]));
    // A pc-dimm on a memfd does not make the boot RAM shareable either.
    let p = plan("-m 1G,slots=2,maxmem=2G -object memory-backend-memfd,id=d,size=1G -device pc-dimm,memdev=d");
    assert!(matches!(p.problems()[..], [Problem::AnonymousRam { .. }]));
}

#[test]
fn qemus_option_syntax_is_read_as_qemu_reads_it() {
    // `,,` is a comma inside a value; a bare key is on; the first bare item is the type.
    let kv = keyval(
        "memory-backend-memfd,id=a,,b,share,size=1G",
        Some("qom-type"),
    );
    assert_eq!(kv["qom-type"], "memory-backend-memfd");
    assert_eq!(kv["id"], "a,b");
    assert_eq!(kv["share"], "on");
    // Arguments of other options are not mistaken for RAM options.
    let words = [
        "-append",
        "console=ttyS0 -m 4G",
        "-name",
        "guest",
        "-object",
        "memory-backend-memfd,id=r,size=64M",
        "-machine",
        "memory-backend=r",
    ];
    let p = RamPlan::parse(&words).unwrap();
    assert_eq!(p.ram_size, None);
    assert_eq!(p.problems(), vec![]);
    assert_eq!(p.name.as_deref(), Some("guest"));
    // The guest's name, as QEMU reads `-name`: `,,` a comma, `guest=` or the first item.
    let name = |arg: &str| RamPlan::parse(&["-name", arg]).unwrap().name;
    assert_eq!(name("web,,1,debug-threads=on").as_deref(), Some("web,1"));
    assert_eq!(name("debug-threads=on,guest=db").as_deref(), Some("db"));
    assert_eq!(name("debug-threads=on"), None);
    assert_eq!(
        RamPlan::parse(&["-m", "1G", "-object"]).unwrap_err(),
        ArgsError::MissingArgument("-object".into())
    );
    assert!(matches!(
        RamPlan::parse(&["-object", "{not json"]).unwrap_err(),
        ArgsError::BadJson { .. }
    ));
    // Each option names itself, not `-object`.
    let e = RamPlan::parse(&["-blockdev", "{\"driver\":"]).unwrap_err();
    assert!(e.to_string().starts_with("-blockdev {\"driver\""), "{e}");
    // QEMU's single-quoted JSON is QEMU's to take: read, not refused.
    assert!(RamPlan::parse(&["-device", "{'driver':'virtio-net-pci'}"]).is_ok());
    let p = RamPlan::parse(&[
        "-object",
        "{'qom-type':'memory-backend-ram','id':'d0','size':1048576}",
        "-device",
        r#"{'driver':'pc-dimm','memdev':'d0','id':'it\'s "a" dimm'}"#,
    ])
    .unwrap();
    assert_eq!(p.used, vec![("d0".to_string(), "pc-dimm".to_string())]);
}

/// libvirt's JSON `-device` (a DIMM on a backend that is no memfd) is read as the
/// keyval form is: the problem is found, not missed.
#[test]
fn a_json_device_names_its_memory_backend() {
    let p = RamPlan::parse(&[
        "-machine",
        "memory-backend=ram0",
        "-object",
        r#"{"qom-type":"memory-backend-memfd","id":"ram0","size":1073741824,"share":true}"#,
        "-object",
        r#"{"qom-type":"memory-backend-ram","id":"dimm0","size":1073741824}"#,
        "-device",
        r#"{"driver":"pc-dimm","memdev":"dimm0","id":"d0"}"#,
    ])
    .unwrap();
    assert!(
        matches!(&p.problems()[..], [Problem::NotMemfd { .. }]),
        "{:?}",
        p.problems()
    );
}

#[test]
fn the_user_qemu_switches_to_is_read() {
    assert_eq!(plan("-m 1G -runas qemu").runs_as.as_deref(), Some("qemu"));
    assert_eq!(
        plan("-run-with chroot=/srv/q,user=107:107 -m 1G")
            .runs_as
            .as_deref(),
        Some("107:107")
    );
    assert_eq!(plan("-run-with async-teardown=on").runs_as, None);
    assert_eq!(plan("-m 1G").runs_as, None);
}
