use super::*;

#[test]
fn a_process_finds_its_own_fence_and_holds_are_seen_through_both_mappings() {
    let agent = WriteFence::create().unwrap();
    let me = rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    assert!(
        WriteFence::of_process(me.as_fd(), std::process::id())
            .unwrap()
            .is_some(),
        "a fence is among this process's descriptors"
    );
    // Other tests make fences too: this one's, by its descriptor.
    let device = WriteFence::checked(agent._fd.try_clone().unwrap(), "this").unwrap();
    let va = 0x7f00_0000_0000u64;
    assert!(!agent.busy(va));
    {
        let _h = device.hold([(va + 4096, 3 * CHUNK)]);
        assert!(agent.busy(va) && agent.busy(va + 3 * CHUNK + 4095));
    }
    assert!(!agent.busy(va) && !agent.busy(va + 3 * CHUNK));
    // Sealed: the memfd cannot be shrunk under a device's mapping.
    assert!(rustix::fs::ftruncate(&agent._fd, 0).is_err());
    // Closed by a writer whose copies land later: every page busy, for good.
    assert!(!agent.is_closed());
    device.close();
    assert!(agent.is_closed() && agent.busy(va) && agent.busy(0));
}

fn my_tid() -> u32 {
    rustix::thread::gettid().as_raw_nonzero().get() as u32
}

fn my_pid() -> u32 {
    std::process::id()
}

/// The id of a process that has exited and been reaped.
fn a_dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// Thread id `n` of a writer no thread of this host can be: above the kernel's
/// PID_MAX_LIMIT (2^22). A test thread's own id among the records' owners would make
/// `hold_writing` withdraw that record as its own leftover (CI once ran the test on thread
/// 4057, inside the 4000.. owners it declared).
fn other_tid(n: u32) -> u32 {
    (1 << 23) + n
}

/// Fills every record with a declaration of page `va` by process `pid`, thread ids
/// `other_tid(first)` up.
fn every_record_declared(f: &WriteFence, pid: u32, first: u32, va: u64) {
    for r in 0..RECORDS {
        let tid = other_tid(first + r as u32);
        assert_eq!(f.declare(pid, tid, &whole_runs(va, PAGE)), Some(r));
    }
}

/// Makes record `r`'s declaration `age_ns` old.
fn age(f: &WriteFence, r: usize, age_ns: u64) {
    let now = crate::proc::monotonic_ns();
    f.record(r)
        .stamp
        .store(now.saturating_sub(age_ns), Ordering::SeqCst);
}

#[test]
fn a_dead_writer_s_stale_records_are_taken_when_none_is_free_and_nobody_else_s() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let dead = a_dead_pid();
    // Every record left by writers killed inside their calls, still fresh.
    every_record_declared(&f, dead, 2000, va);
    assert_eq!(
        f.hold_writing(&[(va, PAGE)]).record,
        None,
        "fresh: still trusted"
    );
    // Stale, but of a live process (this one), of no process said (0), or being written.
    for r in 0..RECORDS {
        age(&f, r, DECLARATION_FRESH_NS);
    }
    for r in 0..RECORDS {
        f.record(r).pid.store(my_pid(), Ordering::SeqCst);
    }
    assert_eq!(f.hold_writing(&[(va, PAGE)]).record, None, "live writers");
    for r in 0..RECORDS {
        f.record(r).pid.store(0, Ordering::SeqCst);
    }
    assert_eq!(
        f.hold_writing(&[(va, PAGE)]).record,
        None,
        "unknown writers"
    );
    f.record(9).pid.store(dead, Ordering::SeqCst);
    f.record(9).owner.store(LOCKED, Ordering::SeqCst);
    assert_eq!(
        f.hold_writing(&[(va, PAGE)]).record,
        None,
        "one being written"
    );
    // A dead process's stale record is taken, left killed mid-write (odd).
    f.record(9).owner.store(other_tid(2009), Ordering::SeqCst);
    f.record(9).seq.fetch_add(1, Ordering::SeqCst);
    let now = crate::proc::monotonic_ns;
    {
        let h = f.hold_writing(&[(va + 3 * PAGE, 2 * PAGE)]);
        assert_eq!(h.record, Some((9, my_tid())));
        assert_eq!(
            f.declared_whole(my_tid(), va + 4 * PAGE, now()),
            Some(vec![(va + 3 * PAGE, 2)]),
            "the declaration made in it is whole and trusted"
        );
        assert_eq!(
            f.declared_whole(other_tid(2009), va, now()),
            None,
            "the leftover is gone"
        );
        assert_eq!(f.record(9).pid.load(Ordering::SeqCst), my_pid());
    }
    assert_eq!(f.record(9).owner.load(Ordering::SeqCst), 0, "withdrawn");
    assert_eq!(f.record(9).seq.load(Ordering::SeqCst) % 2, 0);
}

#[test]
fn a_write_declaring_nothing_is_not_covered_by_a_leftover_of_its_thread_id() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let now = crate::proc::monotonic_ns;
    // A writer killed inside its call, whose thread id this thread has (a reused id, or
    // another pid namespace's), left its declaration of two pages.
    assert_eq!(
        f.declare(a_dead_pid(), my_tid(), &whole_runs(va, 2 * PAGE)),
        Some(0)
    );
    // This thread's call writes 512 bytes of the first page: nothing is whole.
    let h = f.hold_writing(&[(va + 8, 512)]);
    assert_eq!(h.record, None);
    assert_eq!(
        f.declared_whole(my_tid(), va, now()),
        None,
        "a fault in this call must not have the leftover's pages zeroed"
    );
    assert_eq!(f.record(0).owner.load(Ordering::SeqCst), 0);
    assert_eq!(
        f.record(0).pid.load(Ordering::SeqCst),
        0,
        "a freed record says no pid"
    );
}

#[test]
fn records_of_no_valid_pid_or_stamped_in_the_future_are_never_taken() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let dead = a_dead_pid();
    every_record_declared(&f, dead, 4000, va);
    for r in 0..RECORDS {
        age(&f, r, DECLARATION_FRESH_NS);
    }
    // What a QEMU may write: pids no process has (negative as a C pid_t: a process
    // group to kill(2)), and stamps from the future.
    for r in 0..RECORDS {
        f.record(r)
            .pid
            .store(0x8000_0000 | r as u32, Ordering::SeqCst);
    }
    assert_eq!(f.hold_writing(&[(va, PAGE)]).record, None, "no valid pid");
    for r in 0..RECORDS {
        f.record(r).pid.store(dead, Ordering::SeqCst);
        let later = crate::proc::monotonic_ns() + 100 * DECLARATION_FRESH_NS;
        f.record(r).stamp.store(later, Ordering::SeqCst);
    }
    assert_eq!(
        f.hold_writing(&[(va, PAGE)]).record,
        None,
        "from the future"
    );
    age(&f, 17, DECLARATION_FRESH_NS);
    assert_eq!(f.hold_writing(&[(va, PAGE)]).record, Some((17, my_tid())));
}

#[test]
fn a_writer_whose_record_was_taken_withdraws_nothing_of_the_new_declaration() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let dead = a_dead_pid();
    every_record_declared(&f, my_pid(), 3000, va);
    // Record 4's writer looked dead from here (another pid namespace) and slow: taken.
    f.record(4).pid.store(dead, Ordering::SeqCst);
    age(&f, 4, DECLARATION_FRESH_NS + 1);
    let h = f.hold_writing(&[(va + 8 * PAGE, PAGE)]);
    assert_eq!(h.record, Some((4, my_tid())));
    // Its call returns at last: its withdrawal finds the record another's.
    f.withdraw(4, other_tid(3004));
    let now = crate::proc::monotonic_ns();
    assert_eq!(
        f.declared_whole(my_tid(), va + 8 * PAGE, now),
        Some(vec![(va + 8 * PAGE, 1)])
    );
    drop(h);
    assert_eq!(f.record(4).owner.load(Ordering::SeqCst), 0);
}

#[test]
fn a_declaration_names_its_thread_s_whole_pages_for_the_call_and_goes_with_it() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let now = crate::proc::monotonic_ns;
    {
        // Bytes 100.. of page 0 to byte 99 of page 3: pages 1 and 2 whole.
        let _h = f.hold_writing(&[(va + 100, 3 * PAGE), (va + 10 * PAGE, PAGE)]);
        let runs = f.declared_whole(my_tid(), va + PAGE + 5, now());
        assert_eq!(runs, Some(vec![(va + PAGE, 2), (va + 10 * PAGE, 1)]));
        assert!(f.declared_whole(my_tid(), va + 10 * PAGE, now()).is_some());
        assert_eq!(
            f.declared_whole(my_tid(), va, now()),
            None,
            "page 0 is partial"
        );
        assert_eq!(
            f.declared_whole(my_tid(), va + 3 * PAGE, now()),
            None,
            "page 3 too"
        );
        assert_eq!(
            f.declared_whole(my_tid() + 1, va + PAGE, now()),
            None,
            "another thread"
        );
        assert_eq!(f.declared_whole(0, va + PAGE, now()), None);
        let later = now() + DECLARATION_FRESH_NS;
        assert_eq!(f.declared_whole(my_tid(), va + PAGE, later), None, "stale");
        assert_eq!(
            f.declared_whole(my_tid(), va + PAGE, 0),
            None,
            "from the future"
        );
        assert!(
            f.busy(va) && f.busy(va + 10 * PAGE),
            "the chunks are held too"
        );
        // Being written or withdrawn (odd): not trusted.
        f.record(0).seq.fetch_add(1, Ordering::SeqCst);
        assert_eq!(f.declared_whole(my_tid(), va + PAGE, now()), None, "torn");
        f.record(0).seq.fetch_add(1, Ordering::SeqCst);
        assert!(f.declared_whole(my_tid(), va + PAGE, now()).is_some());
    }
    assert_eq!(
        f.declared_whole(my_tid(), va + PAGE, now()),
        None,
        "withdrawn"
    );
    assert!(!f.busy(va));
    assert!((0..RECORDS).all(|r| f.record(r).owner.load(Ordering::SeqCst) == 0));
    // No whole page: nothing declared, only held.
    let h = f.hold_writing(&[(va + 8, 16)]);
    assert_eq!(h.record, None);
    assert!(f.busy(va));
}

#[test]
fn with_every_record_taken_a_write_is_only_held_and_its_pages_copied() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    every_record_declared(&f, my_pid(), 1000, va);
    let h = f.hold_writing(&[(va + PAGE, PAGE)]);
    assert_eq!(h.record, None);
    assert!(f.busy(va + PAGE));
    assert_eq!(
        f.declared_whole(my_tid(), va + PAGE, crate::proc::monotonic_ns()),
        None
    );
    drop(h);
    f.withdraw(5, other_tid(1005));
    let h = f.hold_writing(&[(va + PAGE, PAGE)]);
    assert_eq!(
        h.record,
        Some((5, my_tid())),
        "a withdrawn record is free again"
    );
}

#[test]
fn a_killed_writer_s_leftover_is_withdrawn_by_its_id_and_two_records_of_one_id_are_not_trusted() {
    let f = WriteFence::create().unwrap();
    let va = 0x7f00_0000_0000u64;
    let now = crate::proc::monotonic_ns;
    // Thread 7 killed inside its call: its record stays.
    assert_eq!(f.declare(my_pid(), 7, &whole_runs(va, PAGE)), Some(0));
    // A thread with the same id (another pid namespace) declares: the leftover goes.
    assert_eq!(
        f.declare(my_pid(), 7, &whole_runs(va + PAGE, PAGE)),
        Some(0)
    );
    assert_eq!(f.declared_whole(7, va, now()), None, "the leftover's page");
    assert_eq!(
        f.declared_whole(7, va + PAGE, now()),
        Some(vec![(va + PAGE, 1)])
    );
    // Two fresh records naming one id (a forged one, or made between the two
    // lookups): which one the faulting thread is blocked in cannot be told.
    assert_eq!(
        f.declare(my_pid(), 8, &whole_runs(va + 2 * PAGE, PAGE)),
        Some(1)
    );
    f.record(1).owner.store(7, Ordering::SeqCst);
    assert_eq!(f.declared_whole(7, va + PAGE, now()), None);
    assert_eq!(f.declared_whole(7, va + 2 * PAGE, now()), None);
    f.withdraw(1, 7);
    assert_eq!(
        f.declared_whole(7, va + PAGE, now()),
        Some(vec![(va + PAGE, 1)])
    );
}

#[test]
fn a_first_fence_is_held_and_declares_nothing() {
    let fd = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, LEN_V1 as u64).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    let agent = WriteFence::map(fd.try_clone().unwrap(), LEN_V1).unwrap();
    agent.magic().store(MAGIC_V1, Ordering::SeqCst);
    let device = WriteFence::checked(fd, "v1").unwrap();
    assert!(!device.declares());
    let va = 0x7f00_0000_0000u64;
    let h = device.hold_writing(&[(va, 4 * PAGE)]);
    assert!(agent.busy(va) && h.record.is_none());
    let now = crate::proc::monotonic_ns();
    assert_eq!(agent.declared_whole(my_tid(), va, now), None);
}

#[test]
fn whole_runs_pack_page_runs_of_at_most_run_pages() {
    assert_eq!(whole_runs(0, PAGE - 1), Vec::<u64>::new());
    assert_eq!(whole_runs(1, 2 * PAGE), vec![PAGE]);
    let big = whole_runs(PAGE, (RUN_PAGES + 3) * PAGE);
    assert_eq!(
        big.iter().map(|&r| unpack_run(r)).collect::<Vec<_>>(),
        vec![(PAGE, RUN_PAGES), (PAGE + RUN_PAGES * PAGE, 3)]
    );
    assert_eq!(whole_runs(u64::MAX - 10, 100), Vec::<u64>::new());
}

#[test]
fn a_bogus_length_holds_at_most_one_call_s_worth_and_never_overflows() {
    let f = WriteFence::create().unwrap();
    let h = f.hold([(u64::MAX - 10, u64::MAX), (0, u64::MAX)]);
    assert!(h.slots.len() <= 1 + (MAX_TRANSFER / CHUNK + 1) as usize);
    assert!(f.busy(0) && f.busy(u64::MAX - 10));
    drop(h);
    assert!(!f.busy(0));
}

#[test]
fn a_memfd_named_as_the_fence_but_not_sealed_or_sized_is_refused() {
    let fake = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fake, LEN as u64).unwrap();
    let e = WriteFence::checked(fake, "fake").unwrap_err();
    assert!(e.to_string().contains("not sealed"), "{e}");
    let small = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&small, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&small, SealFlags::SHRINK).unwrap();
    let e = WriteFence::checked(small, "small").unwrap_err();
    assert!(e.to_string().contains("wrong size"), "{e}");
    let blank = rustix::fs::memfd_create(FENCE_NAME, MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&blank, LEN as u64).unwrap();
    rustix::fs::fcntl_add_seals(&blank, SealFlags::SHRINK).unwrap();
    let e = WriteFence::checked(blank, "blank").unwrap_err();
    assert!(e.to_string().contains("no magic"), "{e}");
    // A FIFO (what a hostile QEMU could put where the fence was) is refused without
    // blocking: nothing is opened, and a FIFO has no seals.
    let dir = std::env::temp_dir().join(format!("fence-fifo-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &dir,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        0,
    )
    .unwrap();
    let fifo = rustix::fs::open(
        &dir,
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NONBLOCK,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let _ = std::fs::remove_file(&dir);
    let e = WriteFence::checked(fifo, "fifo").unwrap_err();
    assert!(e.to_string().contains("no seals"), "{e}");
}
