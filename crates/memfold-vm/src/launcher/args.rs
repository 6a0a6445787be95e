//! QEMU's command line for a guest: what [`GuestSpec`] asks for, spelled as QEMU options.

use std::ffi::OsString;
use std::path::Path;

use super::{Accel, GuestSpec, RamBackend, DATA_DISK_SERIAL, TCG_TB_MIB};
use crate::images;

/// The virtio-serial port's name memfold-guest opens (memfold_wire::guest::PORT_NAME;
/// this crate does not depend on the wire).
fn memfold_guest_port() -> &'static str {
    "org.memfold.guest.0"
}

/// `path` as a value inside QEMU's comma-separated `key=value,...` options: each comma
/// doubled (QEMU's rule), else `/a,b` would end the value at `a`.
fn opt_path(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// QEMU's command line (after the program name) for guest `spec` from image `img`: the
/// accelerator, RAM (memfd shared with memfold, or anonymous with `mem-merge` as
/// [`GuestSpec::mem_merge`] says), one virtio-balloon with free page reporting if
/// [`GuestSpec::free_page_reporting`], the serial console to the file `serial`, QMP on the
/// socket `qmp`, the image's kernel, initramfs and throw-away root disk, and the kernel
/// command line with `extra_kernel_args` appended.
pub fn qemu_args(
    spec: &GuestSpec,
    img: &images::Image,
    accel: Accel,
    serial: &Path,
    qmp: &Path,
    extra_kernel_args: Option<&str>,
) -> Vec<OsString> {
    let mut v: Vec<OsString> = Vec::new();
    let mut push = |args: &[&str]| v.extend(args.iter().map(OsString::from));
    push(&["-name", &spec.name]);
    match accel {
        Accel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => push(&["-accel", &format!("tcg,tb-size={TCG_TB_MIB}")]),
    };
    let mem = format!("{}M", spec.mem_mib);
    match spec.ram {
        RamBackend::Memfd => {
            push(&[
                "-object",
                &format!("memory-backend-memfd,id=ram0,size={mem},share=on"),
            ]);
            push(&["-machine", "q35,memory-backend=ram0", "-m", &mem]);
        }
        RamBackend::Anonymous | RamBackend::AnonymousNoThp => {
            let merge = if spec.mem_merge { "on" } else { "off" };
            push(&["-machine", &format!("q35,mem-merge={merge}"), "-m", &mem]);
        }
    }
    push(&["-smp", &spec.cpus.to_string()]);
    push(&[
        "-display",
        "none",
        "-vga",
        "none",
        "-nodefaults",
        "-no-reboot",
    ]);
    if spec.free_page_reporting || spec.memfold_balloon {
        // A balloon memfoldd drives gives pages back when the guest would otherwise kill
        // a process for memory (`deflate-on-oom`): a target set too low, or a workload
        // that grows faster than memfoldd's next reading of the guest's statistics, costs
        // the host memory, never the guest a process.
        let device = format!(
            "virtio-balloon-pci,id=balloon0{}{}",
            if spec.free_page_reporting {
                ",free-page-reporting=on"
            } else {
                ""
            },
            if spec.memfold_balloon {
                ",deflate-on-oom=on"
            } else {
                ""
            },
        );
        push(&["-device", &device]);
    }
    if let Some(sock) = &spec.guest_channel {
        push(&[
            "-device",
            "virtio-serial-pci,id=memfold-vser",
            "-chardev",
            &format!(
                "socket,id=memfold-guest,path={},server=on,wait=off",
                opt_path(sock)
            ),
            "-device",
            &format!(
                "virtserialport,chardev=memfold-guest,name={}",
                memfold_guest_port()
            ),
        ]);
    }
    // memfoldd's own monitor: for the balloon it drives, and for an enlightened guest's
    // RAM layout (QEMU's split below and above 4 GiB).
    if spec.memfold_balloon || spec.guest_channel.is_some() {
        let sock = qmp.with_file_name("memfold-qmp.sock");
        push(&[
            "-chardev",
            &format!(
                "socket,id=memfold-qmp,path={},server=on,wait=off",
                opt_path(&sock)
            ),
            "-mon",
            "chardev=memfold-qmp,mode=control",
        ]);
    }
    // `file:` takes the rest of the word as the path, commas and all: not escaped.
    push(&["-serial", &format!("file:{}", serial.display())]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", opt_path(qmp)),
    ]);
    v.push("-kernel".into());
    v.push(img.kernel.clone().into());
    v.push("-initrd".into());
    v.push(img.initrd.clone().into());
    // no_timer_check: the kernel's check that the timer ticks through the IO-APIC fails
    // on a loaded host (16 TCG guests booting on 2 cores: "setup_IO_APIC" panic, one guest
    // of 16); virtual machines' kernels skip it, as cloud images do.
    let mut append = String::from("console=ttyS0 panic=-1 quiet no_timer_check");
    let blk = spec.memfold_blk.clone().unwrap_or_default();
    // A disk memfold-blk serves: its vhost-user socket beside the QMP socket.
    let vhost_user = |v: &mut Vec<OsString>, disk: &str| {
        let sock = qmp.with_file_name(format!("blk-{disk}.sock"));
        v.push("-chardev".into());
        v.push(format!("socket,id=blk-{disk},path={},reconnect=1", opt_path(&sock)).into());
        v.push("-device".into());
        v.push(
            format!(
                "vhost-user-blk-pci,chardev=blk-{disk},num-queues={}",
                spec.cpus.max(1)
            )
            .into(),
        );
    };
    if let Some(rootfs) = &img.rootfs {
        if blk.root {
            // memfold-blk serves the image as a base under the guest's own qcow2 overlay.
            vhost_user(&mut v, "root");
        } else {
            // The image is shared by all guests of a profile: writes go to a throw-away
            // overlay.
            v.push("-drive".into());
            v.push(format!("file={},if=virtio,format=raw,snapshot=on", opt_path(rootfs)).into());
        }
        append.push_str(" root=/dev/vda");
    }
    if spec.data_disk.is_some() && blk.data {
        vhost_user(&mut v, "data");
    } else if let Some(d) = &spec.data_disk {
        let mut drive = format!(
            "file={},if=none,id={DATA_DISK_SERIAL},format=raw,readonly=on",
            opt_path(&d.path)
        );
        if let Some(bps) = d.read_bytes_per_sec {
            drive.push_str(&format!(",bps_rd={bps}"));
        }
        if spec.data_disk_direct {
            drive.push_str(",cache.direct=on");
        }
        v.push("-drive".into());
        v.push(drive.into());
        v.push("-device".into());
        v.push(format!("virtio-blk-pci,drive={DATA_DISK_SERIAL},serial={DATA_DISK_SERIAL}").into());
    }
    for extra in [extra_kernel_args, spec.kernel_args.as_deref()]
        .into_iter()
        .flatten()
    {
        append.push(' ');
        append.push_str(extra);
    }
    v.push("-append".into());
    v.push(append.into());
    v
}

#[cfg(test)]
mod tests {
    use super::super::DataDisk;
    use super::*;

    fn spec(ram: RamBackend) -> GuestSpec {
        GuestSpec::new("web-1", "web", 512, ram)
    }

    fn args(spec: &GuestSpec) -> Vec<String> {
        let img = images::Image {
            profile: images::profile("web").unwrap(),
            kernel: "/c/web/vmlinuz".into(),
            initrd: "/c/web/initrd.img".into(),
            rootfs: Some("/c/web/rootfs.ext4".into()),
        };
        qemu_args(
            spec,
            &img,
            Accel::Tcg,
            Path::new("/w/serial.log"),
            Path::new("/w/qmp.sock"),
            Some("init_on_alloc=0"),
        )
        .into_iter()
        .map(|s| s.into_string().unwrap())
        .collect()
    }

    fn has(v: &[String], pair: [&str; 2]) -> bool {
        v.windows(2).any(|w| w == pair)
    }

    #[test]
    fn the_command_line_carries_ram_merging_and_the_balloon_as_the_spec_says() {
        let memfd = args(&spec(RamBackend::Memfd));
        assert!(has(&memfd, ["-machine", "q35,memory-backend=ram0"]));
        assert!(has(
            &memfd,
            ["-object", "memory-backend-memfd,id=ram0,size=512M,share=on"]
        ));
        assert!(!memfd.iter().any(|a| a.contains("balloon")));
        assert!(has(
            &memfd,
            [
                "-append",
                "console=ttyS0 panic=-1 quiet no_timer_check root=/dev/vda init_on_alloc=0"
            ]
        ));
        assert!(has(
            &memfd,
            [
                "-drive",
                "file=/c/web/rootfs.ext4,if=virtio,format=raw,snapshot=on"
            ]
        ));
        assert!(has(&memfd, ["-serial", "file:/w/serial.log"]));
        assert!(has(&memfd, ["-accel", "tcg,tb-size=64"]));
        let anon = args(&spec(RamBackend::Anonymous));
        assert!(has(&anon, ["-machine", "q35,mem-merge=on"]));
        assert!(!anon.iter().any(|a| a.contains("balloon")));
        let plain = args(&GuestSpec {
            mem_merge: false,
            ..spec(RamBackend::AnonymousNoThp)
        });
        assert!(has(&plain, ["-machine", "q35,mem-merge=off"]));
        let fpr = args(&GuestSpec {
            free_page_reporting: true,
            memfold_balloon: false,
            ..spec(RamBackend::Anonymous)
        });
        assert!(has(
            &fpr,
            [
                "-device",
                "virtio-balloon-pci,id=balloon0,free-page-reporting=on"
            ]
        ));
        assert_eq!(fpr.iter().filter(|a| a.contains("balloon")).count(), 1);
        // The balloon memfoldd drives deflates rather than let the guest kill for memory.
        let driven = args(&GuestSpec {
            memfold_balloon: true,
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &driven,
            [
                "-device",
                "virtio-balloon-pci,id=balloon0,deflate-on-oom=on"
            ]
        ));
        let both = args(&GuestSpec {
            free_page_reporting: true,
            memfold_balloon: true,
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &both,
            [
                "-device",
                "virtio-balloon-pci,id=balloon0,free-page-reporting=on,deflate-on-oom=on"
            ]
        ));
    }

    #[test]
    fn a_data_disk_is_read_only_found_by_its_serial_and_throttled_as_asked() {
        let with = |bps| {
            args(&GuestSpec {
                data_disk: Some(DataDisk {
                    path: "/w/data.img".into(),
                    read_bytes_per_sec: bps,
                }),
                ..spec(RamBackend::Memfd)
            })
        };
        assert!(has(
            &with(Some(64 << 20)),
            [
                "-drive",
                "file=/w/data.img,if=none,id=memfold-data,format=raw,readonly=on,bps_rd=67108864"
            ]
        ));
        let v = with(None);
        assert!(has(
            &v,
            [
                "-drive",
                "file=/w/data.img,if=none,id=memfold-data,format=raw,readonly=on"
            ]
        ));
        let direct = args(&GuestSpec {
            data_disk: Some(DataDisk {
                path: "/w/data.img".into(),
                read_bytes_per_sec: None,
            }),
            data_disk_direct: true,
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &direct,
            [
                "-drive",
                "file=/w/data.img,if=none,id=memfold-data,format=raw,readonly=on,cache.direct=on"
            ]
        ));
        assert!(has(
            &v,
            [
                "-device",
                "virtio-blk-pci,drive=memfold-data,serial=memfold-data"
            ]
        ));
        let own = args(&GuestSpec {
            kernel_args: Some("memfold.break_at=60".into()),
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &own,
            [
                "-append",
                "console=ttyS0 panic=-1 quiet no_timer_check root=/dev/vda init_on_alloc=0 memfold.break_at=60"
            ]
        ));
        // After the root disk: the root stays /dev/vda.
        let drives: Vec<_> = v
            .windows(2)
            .filter(|w| w[0] == "-drive")
            .map(|w| &w[1])
            .collect();
        assert!(drives[0].contains("rootfs.ext4") && drives[1].contains("data.img"));
    }

    #[test]
    fn disks_memfold_blk_serves_are_vhost_user_devices_on_their_sockets() {
        use super::super::BlkDisks;
        let v = args(&GuestSpec {
            data_disk: Some(DataDisk {
                path: "/w/data.img".into(),
                read_bytes_per_sec: None,
            }),
            cpus: 2,
            memfold_blk: Some(BlkDisks {
                data: true,
                root: true,
                ..BlkDisks::default()
            }),
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &v,
            [
                "-chardev",
                "socket,id=blk-root,path=/w/blk-root.sock,reconnect=1"
            ]
        ));
        assert!(has(
            &v,
            [
                "-device",
                "vhost-user-blk-pci,chardev=blk-root,num-queues=2"
            ]
        ));
        assert!(has(
            &v,
            [
                "-chardev",
                "socket,id=blk-data,path=/w/blk-data.sock,reconnect=1"
            ]
        ));
        assert!(has(
            &v,
            [
                "-device",
                "vhost-user-blk-pci,chardev=blk-data,num-queues=2"
            ]
        ));
        assert!(
            !v.iter()
                .any(|a| a.contains("-drive") || a.contains("file=")),
            "{v:?}"
        );
        // The root disk first: it stays /dev/vda.
        let root = v
            .iter()
            .position(|a| a.contains("chardev=blk-root"))
            .unwrap();
        let data = v
            .iter()
            .position(|a| a.contains("chardev=blk-data"))
            .unwrap();
        assert!(root < data);
        assert!(v.iter().any(|a| a.contains("root=/dev/vda")));
        // Only the data disk: the root stays QEMU's.
        let d = args(&GuestSpec {
            data_disk: Some(DataDisk {
                path: "/w/data.img".into(),
                read_bytes_per_sec: None,
            }),
            memfold_blk: Some(BlkDisks {
                data: true,
                ..BlkDisks::default()
            }),
            ..spec(RamBackend::Memfd)
        });
        assert!(has(
            &d,
            [
                "-drive",
                "file=/c/web/rootfs.ext4,if=virtio,format=raw,snapshot=on"
            ]
        ));
        assert!(has(
            &d,
            [
                "-device",
                "vhost-user-blk-pci,chardev=blk-data,num-queues=1"
            ]
        ));
        assert!(!d.iter().any(|a| a.contains("data.img")));
    }

    /// QEMU's command line for `spec` with every path under a folder with a comma.
    fn comma_args(spec: &GuestSpec) -> Vec<String> {
        let img = images::Image {
            profile: images::profile("web").unwrap(),
            kernel: "/c,1/web/vmlinuz".into(),
            initrd: "/c,1/web/initrd.img".into(),
            rootfs: Some("/c,1/web/rootfs.ext4".into()),
        };
        let (serial, qmp) = (Path::new("/w,x/serial.log"), Path::new("/w,x/qmp.sock"));
        qemu_args(spec, &img, Accel::Tcg, serial, qmp, None)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn commas_in_paths_are_doubled_in_every_comma_separated_option() {
        let v = comma_args(&GuestSpec {
            data_disk: Some(DataDisk {
                path: "/d,1/data.img".into(),
                read_bytes_per_sec: None,
            }),
            guest_channel: Some("/run/c,h/g.sock".into()),
            memfold_balloon: true,
            ..spec(RamBackend::Memfd)
        });
        assert!(has(&v, ["-qmp", "unix:/w,,x/qmp.sock,server=on,wait=off"]));
        assert!(has(
            &v,
            [
                "-chardev",
                "socket,id=memfold-qmp,path=/w,,x/memfold-qmp.sock,server=on,wait=off"
            ]
        ));
        assert!(has(
            &v,
            [
                "-chardev",
                "socket,id=memfold-guest,path=/run/c,,h/g.sock,server=on,wait=off"
            ]
        ));
        assert!(has(
            &v,
            [
                "-drive",
                "file=/c,,1/web/rootfs.ext4,if=virtio,format=raw,snapshot=on"
            ]
        ));
        assert!(has(
            &v,
            [
                "-drive",
                "file=/d,,1/data.img,if=none,id=memfold-data,format=raw,readonly=on"
            ]
        ));
        // `-serial file:` takes the rest as the path; -kernel and -initrd are whole words.
        assert!(has(&v, ["-serial", "file:/w,x/serial.log"]));
        assert!(has(&v, ["-kernel", "/c,1/web/vmlinuz"]));
        assert!(has(&v, ["-initrd", "/c,1/web/initrd.img"]));
        let blk = comma_args(&GuestSpec {
            data_disk: Some(DataDisk {
                path: "/d,1/data.img".into(),
                read_bytes_per_sec: None,
            }),
            memfold_blk: Some(super::super::BlkDisks {
                data: true,
                root: true,
                ..Default::default()
            }),
            ..spec(RamBackend::Memfd)
        });
        for disk in ["root", "data"] {
            let want = format!("socket,id=blk-{disk},path=/w,,x/blk-{disk}.sock,reconnect=1");
            assert!(has(&blk, ["-chardev", &want]), "{blk:?}");
        }
    }

    #[test]
    fn an_enlightened_guest_gets_its_virtio_serial_port() {
        let plain = args(&spec(RamBackend::Memfd));
        assert!(!plain.iter().any(|a| a.contains("virtserialport")));
        let v = args(&GuestSpec {
            guest_channel: Some("/run/ch/g.sock".into()),
            ..spec(RamBackend::Memfd)
        });
        assert!(has(&v, ["-device", "virtio-serial-pci,id=memfold-vser"]));
        assert!(has(
            &v,
            [
                "-chardev",
                "socket,id=memfold-guest,path=/run/ch/g.sock,server=on,wait=off"
            ]
        ));
        assert!(has(
            &v,
            [
                "-device",
                "virtserialport,chardev=memfold-guest,name=org.memfold.guest.0"
            ]
        ));
    }
}
