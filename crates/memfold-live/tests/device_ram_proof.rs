//! A block device acts only on guest RAM its process holds (memfoldd looks among its
//! descriptors; `daemon/devices.rs`). memfoldd's side, with real agents in this process,
//! an honest device played through the wire's [`LandedReporter`], and a hostile one in a
//! child process (this binary again, [`hostile_device`]) that holds guest b's RAM memfd
//! only. A test binary of its own: the in-process agents and memfoldds of two tests in
//! one process disturb each other.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memfold_ids::{BaseBlock, DiskId, FillId, Gfn};
use memfold_wire::{Conn, LandedReporter, RamFile, ToDaemon, ToDevice, PROTOCOL_VERSION};
use rand::{rngs::SmallRng, SeedableRng};

use common::{eventually, ram_file, GuestRam, PAGE};

const PAGES: usize = 2048;
const PAGES_B: usize = 2560;

/// The environment variable that makes [`hostile_device`] run (its arguments, as
/// `name=value` pairs separated by spaces).
const ROLE: &str = "MEMFOLD_HOSTILE_DEVICE";

/// The line the hostile device prints once its fills are answered.
const ANSWERED: &str = "hostile device: fills answered";

/// The first 16 bytes of page `g` of `ram`, as a nonce.
fn prefix(ram: &GuestRam, g: usize) -> [u64; 2] {
    let mut p = vec![0u8; PAGE];
    ram.read(g, &mut p);
    let word = |i: usize| u64::from_ne_bytes(p[8 * i..8 * i + 8].try_into().unwrap());
    [word(0), word(1)]
}

/// Guest b's device, run in a child process by the test below: it holds b's RAM memfd
/// (opened through the parent's descriptor) and the base, names b's RAM once, then a's
/// in two fills (nonces: the prefixes a's pages begin with) and a report. Checks that
/// both fills are answered empty, and that no news of held blocks reach it until the
/// parent says so on its input.
#[test]
#[ignore = "the hostile device's process, spawned by a_device_acts_only_on_guest_ram_it_holds"]
fn hostile_device() {
    let args = std::env::var(ROLE).expect("spawned by the parent test, with its arguments");
    let arg = |k: &str| -> String {
        args.split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}"))
            .to_string()
    };
    let num = |k: &str| arg(k).parse::<u64>().unwrap();
    let (ram_a, ram_b) = (
        RamFile {
            dev: num("a_dev"),
            ino: num("a_ino"),
        },
        RamFile {
            dev: num("b_dev"),
            ino: num("b_ino"),
        },
    );
    let b_memfd = std::fs::File::open(arg("b_fd")).unwrap();
    let base = std::fs::File::open(arg("base")).unwrap();
    let disk = DiskId(num("disk"));
    // The premise: this process holds b's RAM, not a's.
    let held: Vec<(u64, u64)> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        })
        .collect();
    assert!(held.contains(&(ram_b.dev, ram_b.ino)));
    assert!(!held.contains(&(ram_a.dev, ram_a.ino)), "it holds a's RAM");

    let c = Conn::connect(std::path::Path::new(&arg("socket"))).unwrap();
    let hello = ToDaemon::DeviceHello {
        version: PROTOCOL_VERSION,
        bases: vec![disk],
    };
    c.send(&hello, &[base.as_fd()]).unwrap();
    let landed = |ram, g| ToDaemon::ReadLanded {
        ram,
        gfns: vec![Gfn(g)],
        landed_ns: 0,
        bases: vec![],
    };
    c.send(&landed(ram_b, 5), &[]).unwrap();
    for (fill, k) in [(1, "p1"), (2, "p2")] {
        let m = ToDaemon::FillRead {
            ram: ram_a,
            fill: FillId(fill),
            nonce: [num(&format!("{k}_n0")), num(&format!("{k}_n1"))],
            pages: vec![(Gfn(num(k) as u32), BaseBlock { disk, block: 0 })],
        };
        c.send(&m, &[]).unwrap();
    }
    c.send(&landed(ram_a, 7), &[]).unwrap();
    drop(b_memfd);

    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let (mut answers, mut news) = (Vec::new(), Vec::new());
    while answers.len() < 2 {
        match c.recv::<ToDevice>().unwrap().expect("connected").0 {
            ToDevice::Filled { fill, gfns } => answers.push((fill, gfns)),
            ToDevice::Held { blocks } => news.extend(blocks),
        }
    }
    println!("{ANSWERED}");
    // News until the parent, having had a's domain learn more blocks, says it is done.
    let reader = c.try_clone().unwrap();
    let news_thread = std::thread::spawn(move || {
        reader.set_recv_timeout(Duration::from_millis(100)).unwrap();
        let mut news = Vec::new();
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            match reader.recv::<ToDevice>() {
                Ok(Some((ToDevice::Held { blocks }, _))) => news.extend(blocks),
                Ok(None) => break,
                _ => {}
            }
        }
        news
    });
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    c.shutdown();
    news.extend(news_thread.join().unwrap());
    answers.sort_by_key(|(f, _)| *f);
    assert_eq!(
        answers,
        [(FillId(1), vec![]), (FillId(2), vec![])],
        "fills of a's pages by b's device"
    );
    assert!(news.is_empty(), "b's device told what a holds: {news:?}");
}

/// Under `--share-domains vm`, guest b's device (it holds b's RAM memfd, as QEMU b sent
/// it) names guest a's RAM: in fills whose nonce is the prefix a's pages already begin
/// with (a page prefix common to many guests' pages), and in a report. Believed, memfoldd
/// had a's agent map base blocks over a's own pages, and told b's device which blocks
/// a's domain holds. Nothing of it happens: a's pages keep their bytes, no fill reaches
/// a, the fills are answered empty, and b's device hears no news of a's domain.
#[test]
fn a_device_acts_only_on_guest_ram_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd_with(memfold_live::daemon::DaemonConfig {
        domains: memfold_live::daemon::DomainRule::Vm,
        ..common::daemon_config(dir.path(), common::read_fill_engine())
    });
    let mut rng = SmallRng::seed_from_u64(61);
    let (a, b) = common::two_random_guests(&socket, &mut rng, PAGES, PAGES_B);
    let (base_path, base, disk) = common::random_base(dir.path(), &mut rng, 8);
    let block = |k: usize| BaseBlock {
        disk,
        block: k as u64,
    };
    // a's own device lands blocks `ks` twice each in a: a's domain holds them.
    let dev_a = LandedReporter::spawn_with_bases(
        &socket,
        vec![(disk, std::fs::File::open(&base_path).unwrap().into())],
    )
    .unwrap();
    let land = |ks: std::ops::Range<usize>| {
        let (mut gfns, mut bases) = (Vec::new(), Vec::new());
        for k in ks.clone() {
            for copy in 0..2 {
                let g = 300 + 10 * k + copy;
                a.write(g, 0, &base[k]);
                bases.push((gfns.len() as u32, block(k)));
                gfns.push(Gfn(g as u32));
            }
        }
        assert!(dev_a.report_from(ram_file(&a), gfns, bases));
        eventually("a's blocks held", || {
            ks.clone().all(|k| dev_a.held(block(k)))
        });
    };
    land(0..4);

    // b's device, in a child process holding b's RAM memfd, names a's.
    let (p1, p2) = (1700usize, 1701usize);
    let mut before = (vec![0u8; PAGE], vec![0u8; PAGE]);
    a.read(p1, &mut before.0);
    a.read(p2, &mut before.1);
    let (ra, rb) = (ram_file(&a), ram_file(&b));
    let (n1, n2) = (prefix(&a, p1), prefix(&a, p2));
    let args = format!(
        "socket={} base={} disk={} a_dev={} a_ino={} b_dev={} b_ino={} b_fd=/proc/{}/fd/{} \
         p1={p1} p1_n0={} p1_n1={} p2={p2} p2_n0={} p2_n1={}",
        socket.display(),
        base_path.display(),
        disk.0,
        ra.dev,
        ra.ino,
        rb.dev,
        rb.ino,
        std::process::id(),
        b.fd.as_raw_fd(),
        n1[0],
        n1[1],
        n2[0],
        n2[1],
    );
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "hostile_device", "--nocapture"])
        .env(ROLE, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut said = String::new();
    let mut line = String::new();
    while out.read_line(&mut line).unwrap() > 0 && !line.contains(ANSWERED) {
        said.push_str(&line);
        line.clear();
    }
    // Blocks a's domain learns from now on are news for a's device only. A child that
    // never answered (it failed, or `--exact` matched no test) fails below, with its
    // output.
    let answered = line.contains(ANSWERED);
    if answered {
        land(4..8);
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.write_all(b"done\n");
    drop(stdin);
    let done = child.wait_with_output().unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    assert!(
        done.status.success(),
        "the hostile device: {said}{line}{rest}\n{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(
        answered,
        "the hostile device never said its fills were answered: {said}{line}{rest}"
    );
    assert!(
        rest.contains("test result: ok. 1 passed"),
        "the hostile device's test did not run: {said}{line}{rest}"
    );

    let mut now = vec![0u8; PAGE];
    for (g, was) in [(p1, &before.0), (p2, &before.1)] {
        a.read(g, &mut now);
        assert!(&now == was, "a's page {g} lost its bytes");
        assert!(!a.on_pool(g), "a's page {g} was mapped over");
    }
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(common::vm_named(&s, "a").read_fills, 0, "fills reached a");
}
