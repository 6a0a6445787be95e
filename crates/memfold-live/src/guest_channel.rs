//! Enlightened guests' channels (issue 17; PV §3.1): memfoldd asks each guest that runs
//! `memfold-guest` what its pages are, over its virtio-serial port (the protocol:
//! [`memfold_wire::guest`]), and hands the answer to the engine as page categories
//! ([`memfold_core::Engine::guest_categories`]).
//!
//! **Where the channel is.** QEMU listens on a Unix socket for the port
//! (`-chardev socket,id=mfg,path=DIR/NAME.sock,server=on,wait=off -device
//! virtserialport,chardev=mfg,name=org.memfold.guest.0`); memfoldd, given `DIR`
//! (`--guest-channels DIR`), connects to `DIR/NAME.sock` for each attached guest named
//! `NAME` (its agent's name, QEMU's `-name`). The folder is the operator's: memfoldd
//! connects to no path a guest or its QEMU chose, and asks a socket only if the guest's
//! own QEMU serves it (the name is the agent's word: any QEMU may claim another guest's
//! name first, so guests of one name each get a channel, and each asks only a socket
//! its own QEMU serves). A name with anything but letters, digits, `.`, `_` and `-`, or
//! one that several attached RAM regions of one QEMU share, gets no channel.
//!
//! **Threads.** One thread per enlightened guest ([`GuestChannels`]): it connects,
//! asks every `interval`, reads the answer with a timeout and bounded lines, checks it
//! ([`read_report`]) and sends it to memfoldd's main loop, which applies it between scan
//! steps. A slow, silent or hostile guest only holds its own thread; its reports can only
//! change how its own pages are scanned (every share is still confirmed byte for byte and
//! checked by the agent under write-protection), and a report that does not fit its RAM
//! is refused whole.

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memfold_core::categories::{CategoryMap, CategoryMapBuilder, LayoutError, PageInfo, RamLayout};
use memfold_core::engine::free_discard::WatchRound;
use memfold_core::ids::VmId;
use memfold_core::Engine;
use memfold_sys::deadline::DeadlineReader;
use memfold_wire::guest::{
    decode_from_guest, encode_to_guest, FromGuest, GuestMeminfo, GuestWireError, LineReader,
    ToGuest, GUEST_PROTOCOL_VERSION, MAX_CHUNKS, MAX_GUEST_LINE,
};
use memfold_wire::name::shown;
#[cfg(test)]
use memfold_wire::name::SHOWN_CHARS;
use memfold_wire::GuestPages;

use crate::monitor::QemuLayouts;

/// How long a report may take to come, whole, at the least; a larger guest's walk of
/// its frames takes longer ([`report_timeout`]).
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Time a report may take per guest page beyond [`REPORT_TIMEOUT`]: a 512 MiB `db`
/// guest's took up to ~1 s under TCG, ~8 µs a page, most of it its walk of
/// `/proc/kpageflags` (docs/enlightened.md), so more than twice that.
const REPORT_PER_PAGE: Duration = Duration::from_micros(20);

/// The longest a report may take, whatever the guest's size.
const REPORT_TIMEOUT_MAX: Duration = Duration::from_secs(120);

/// How long a report of a guest of `ram_pages` pages may take to come, whole: 10 s, and
/// 20 µs a page more (a fixed 10 s failed every report of a guest whose walk takes
/// longer, a few GiB under TCG, each walk then done again for nothing), at most 120 s.
pub fn report_timeout(ram_pages: u64) -> Duration {
    let per_page = REPORT_PER_PAGE.saturating_mul(u32::try_from(ram_pages).unwrap_or(u32::MAX));
    (REPORT_TIMEOUT + per_page).min(REPORT_TIMEOUT_MAX)
}

/// A guest's report, checked and in memfold's gfns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestReport {
    /// Its pages' categories, by gfn: built as its runs came (under a byte a page,
    /// whatever the runs).
    pub map: CategoryMap,
    /// Frames its runs covered, as it said at its end (those past the RAM included).
    pub frames: u64,
    /// Its RAM's layout, by which frames were mapped to gfns.
    pub layout: RamLayout,
    /// Its `/proc/meminfo`, KiB.
    pub meminfo: GuestMeminfo,
    /// Its agent and kernel.
    pub agent: String,
    /// Its free pages may be discarded (no page poisoning; `FromGuest::Ram::discard`).
    pub discard: bool,
    /// The guest agent's own time walking its kernel's books, µs, as it said
    /// (`FromGuest::End::walk_us`; 0 from an older agent). Told, not checked: shown
    /// only, never acted on.
    pub walk_us: u64,
}

impl GuestReport {
    /// Bytes it holds for its pages: bounded by the guest's size, not by its runs.
    pub fn bytes(&self) -> usize {
        self.map.bytes()
    }
}

/// The bytes of other requests' lines a report may skip for a guest of `ram_pages`
/// pages: a whole answer's worth (a run of a page or more is at most ~24 bytes of
/// JSON), at most the protocol's longest answer.
fn stale_max(ram_pages: u64) -> u64 {
    let longest = (u64::from(MAX_CHUNKS) + 3) * MAX_GUEST_LINE as u64;
    (64u64 << 10)
        .saturating_add(ram_pages.saturating_mul(24))
        .min(longest)
}

/// `ranges` sorted, those that touch or overlap joined: where runs may lie.
fn joined(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut v = ranges.to_vec();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Why a guest's report was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The channel or a line failed.
    #[error(transparent)]
    Wire(#[from] GuestWireError),
    /// Its RAM ranges do not fit its RAM.
    #[error("RAM layout: {0}")]
    Layout(#[from] LayoutError),
    /// The guest said it could not answer.
    #[error("the guest agent failed: {0}")]
    Guest(String),
    /// A line out of its place in the answer.
    #[error("answer {seq}: {what}")]
    Protocol {
        /// The request.
        seq: u64,
        /// What was out of place.
        what: String,
    },
    /// A run outside the guest's RAM, or before the runs already sent.
    #[error("run of {pages} frames at frame {pfn:#x}: {why}")]
    BadRun {
        /// First frame.
        pfn: u64,
        /// Frames.
        pages: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The channel's socket is served by another process than the guest's QEMU.
    #[error(
        "{path} is served by {}, not by the guest's QEMU (pid {expected}): not asked",
        found.map_or("an unknown process".to_string(), |p| format!("pid {p}"))
    )]
    WrongServer {
        /// The socket.
        path: String,
        /// The guest's QEMU.
        expected: u32,
        /// The process that made the listening socket (`SO_PEERCRED`), if known.
        found: Option<u32>,
    },
    /// A code that is no category.
    #[error("code {code} at frame {pfn:#x} is no page category")]
    BadCode {
        /// The code.
        code: u32,
        /// Its frame.
        pfn: u64,
    },
}

/// Asks for report `seq` on `out` and reads it from `lines`, for a guest of `ram_pages`
/// pages (its RAM memfd's size / 4096) whose RAM QEMU laid out as `qemu` (`None`: not
/// known; the layout is then inferred from the guest's ranges, [`RamLayout::for_ranges`]).
/// Lines of any other request (answers that came late, or were under way to a channel
/// before this one) are skipped, at most one whole answer's worth: only lines numbered
/// `seq` make the report, so it was sampled after this request was sent.
///
/// Errors: [`ReportError`]; after a [`ReportError::Wire`] the channel is not in step
/// and should be dropped.
pub fn read_report<R: std::io::BufRead>(
    lines: &mut LineReader<R>,
    out: &mut impl Write,
    seq: u64,
    ram_pages: u64,
    qemu: Option<RamLayout>,
) -> Result<GuestReport, ReportError> {
    out.write_all(&encode_to_guest(&ToGuest::Categories {
        v: GUEST_PROTOCOL_VERSION,
        seq,
    }))
    .map_err(GuestWireError::Io)?;
    out.flush().map_err(GuestWireError::Io)?;
    let proto = |what: String| ReportError::Protocol { seq, what };
    let pages = u32::try_from(ram_pages)
        .map_err(|_| proto(format!("a guest of {ram_pages} pages: more than gfns name")))?;
    // The report, its map as it is built, and its declared ranges, joined.
    type Building = (GuestReport, CategoryMapBuilder, Vec<(u64, u64)>);
    let mut report: Option<Building> = None;
    let (mut chunks, mut frames, mut next_pfn, mut nruns) = (0u32, 0u64, 0u64, 0u64);
    // Stale bytes skipped at most: one whole answer's worth, of this guest's size. Of
    // any other number: an answer under way to an earlier channel (memfoldd restarted,
    // the guest re-attached) may carry any.
    let mut stale = 0u64;
    let mut split = Vec::with_capacity(2);
    loop {
        let line = lines.line()?;
        let len = line.len() as u64 + 1;
        let m = decode_from_guest(line)?;
        if m.seq() != seq {
            stale += len;
            if stale > stale_max(ram_pages) {
                return Err(proto("too many lines of other requests' answers".into()));
            }
            continue;
        }
        match (m, report.as_mut()) {
            (FromGuest::Error { what, .. }, _) => return Err(ReportError::Guest(what)),
            (
                FromGuest::Ram {
                    agent,
                    kernel,
                    ranges,
                    meminfo,
                    discard,
                    ..
                },
                None,
            ) => {
                let ranges: Vec<(u64, u64)> = ranges.iter().map(|r| (r[0], r[1])).collect();
                let rep = GuestReport {
                    // Set at the end, from the map built as the runs come.
                    map: CategoryMapBuilder::new(0).finish(),
                    frames: 0,
                    layout: RamLayout::for_ranges(ram_pages, &ranges, qemu)?,
                    meminfo,
                    // The guest's words, in every reader's statistics: shown escaped.
                    agent: shown(&format!("{agent} (kernel {kernel})")),
                    discard,
                    walk_us: 0,
                };
                report = Some((rep, CategoryMapBuilder::new(pages), joined(&ranges)));
            }
            (FromGuest::Runs { first, runs, .. }, Some((r, map, declared))) => {
                chunks += 1;
                if chunks > MAX_CHUNKS {
                    return Err(proto(format!("over {MAX_CHUNKS} chunks")));
                }
                let mut pfn = first;
                if pfn < next_pfn {
                    return Err(ReportError::BadRun {
                        pfn,
                        pages: 0,
                        why: "before the runs already sent",
                    });
                }
                for [code, n] in runs {
                    let info = u8::try_from(code)
                        .ok()
                        .and_then(PageInfo::from_code)
                        .ok_or(ReportError::BadCode { code, pfn })?;
                    let n = n as u64;
                    let bad = |why| ReportError::BadRun { pfn, pages: n, why };
                    let end = pfn.checked_add(n).ok_or(bad("past the end of frames"))?;
                    let l = r.layout;
                    if !l.takes_run(pfn, end) {
                        return Err(bad("outside the guest's RAM"));
                    }
                    // Runs are in order: ranges wholly before this one are done with.
                    let skip = declared.iter().take_while(|d| d.1 <= pfn).count();
                    declared.drain(..skip);
                    if !declared.first().is_some_and(|d| d.0 <= pfn && end <= d.1) {
                        return Err(bad("in no RAM range the guest declared"));
                    }
                    // A run is a frame or more of a declared range: no more runs than
                    // the guest has pages (a DIMM's past its RAM count too).
                    nruns += 1;
                    if nruns > ram_pages {
                        return Err(bad("more runs than the guest has pages"));
                    }
                    // Frames past the RAM (a hot-plugged DIMM's, exact layout) dropped.
                    split.clear();
                    l.runs(pfn, n, info, &mut split);
                    for &g in &split {
                        map.push(g)
                            .map_err(|_| bad("not a run of the guest's RAM"))?;
                    }
                    frames += n;
                    pfn = end;
                }
                next_pfn = pfn;
            }
            (
                FromGuest::End {
                    chunks: c,
                    frames: f,
                    walk_us,
                    ..
                },
                Some(_),
            ) => {
                if (c, f) != (chunks, frames) {
                    return Err(proto(format!(
                        "end says {c} chunks of {f} frames, {chunks} of {frames} came"
                    )));
                }
                let (mut r, map, _) = report.expect("matched Some");
                r.map = map.finish();
                r.frames = frames;
                r.walk_us = walk_us;
                return Ok(r);
            }
            (m, _) => {
                return Err(proto(
                    format!("unexpected {m:?}").chars().take(200).collect(),
                ))
            }
        }
    }
}

/// Whether `name` may name a channel's socket in the operator's folder.
pub fn channel_name_ok(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= 100
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// What a channel thread sends the main loop.
/// Whether the free pages of `rep` may be discarded (issue 17): its guest says so (no
/// page poisoning), and its frames map to gfns without doubt — QEMU gave the layout
/// ([`RamLayout::exact`]), or all the guest's RAM lies below 4 GiB, where frame = gfn.
/// With RAM above 4 GiB and no word from QEMU the split is inferred from the highest
/// frame the guest lists as RAM, and a guest booted with `mem=` or `memmap=` hides the
/// top of its RAM: every frame above 4 GiB would then name another page, in use. (The
/// books and the scan's order may be that wrong; a discard may not.)
pub fn discards_allowed(rep: &GuestReport) -> bool {
    rep.discard && (rep.layout.exact || rep.layout.high == 0)
}

/// A channel thread's news: the guest, when its request was sent, how long the answer
/// took, and the report (or why there is none).
type Sent = (VmId, Instant, Duration, Result<GuestReport, ReportError>);

/// A guest's channel: its thread's stop flag, and what it last said.
struct Channel {
    name: String,
    /// Its QEMU's pid: with the name, which statistics are its guest's (another QEMU may
    /// attach a guest of the same name later, another tenant's).
    pid: u32,
    stop: Arc<AtomicBool>,
    last: Option<(RamLayout, GuestMeminfo, String)>,
    last_error: Option<String>,
    refused: u64,
    channel_errors: u64,
    /// The guest's armed free-page watch round and when memfoldd learned it was armed:
    /// a report asked for after that instant may discard its pages
    /// ([`memfold_core::Engine::discard_free`]).
    armed: Option<(WatchRound, Instant)>,
    /// Reports answered, their total and longest round trip.
    answered: u32,
    answer_total: Duration,
    answer_max: Duration,
    /// Reports whose guest said how long its walk took, and those walks' total, µs.
    walked: u32,
    walk_total_us: u64,
}

/// The channels of enlightened guests (see the module documentation).
pub struct GuestChannels {
    dir: PathBuf,
    interval: Duration,
    layouts: Arc<QemuLayouts>,
    channels: BTreeMap<VmId, Channel>,
    tx: mpsc::Sender<Sent>,
    rx: mpsc::Receiver<Sent>,
}

impl GuestChannels {
    /// Channels at `dir/NAME.sock`, asked every `interval`; the guests' RAM layouts
    /// asked of their QEMUs through `layouts`.
    pub fn new(dir: &Path, interval: Duration, layouts: Arc<QemuLayouts>) -> Self {
        let (tx, rx) = mpsc::channel();
        GuestChannels {
            dir: dir.to_path_buf(),
            interval,
            layouts,
            channels: BTreeMap::new(),
            tx,
            rx,
        }
    }

    /// Starts a channel for each attached guest of the engine with a socket in the
    /// folder and none yet; stops those of guests gone or detached.
    pub fn sync(&mut self, engine: &Engine) {
        let attached: Vec<(VmId, u32)> = engine
            .vms()
            .into_iter()
            .filter(|v| v.2)
            .map(|v| (v.0, v.1))
            .collect();
        self.channels.retain(|id, c| {
            let keep = attached.iter().any(|a| a.0 == *id);
            if !keep {
                c.stop.store(true, Ordering::Relaxed);
            }
            keep
        });
        for &(id, pid) in &attached {
            if self.channels.contains_key(&id) {
                continue;
            }
            let Some(name) = engine.vm_name(id) else {
                continue;
            };
            if !channel_name_ok(name) {
                continue;
            }
            // Names are the agents' word: another QEMU may attach a guest of this name
            // first. Each guest still gets its own channel, whose thread asks the socket
            // only if its own QEMU serves it; only regions of one QEMU sharing a name
            // are ambiguous (which is the guest's RAM?) and get none.
            let named: Vec<(VmId, u32)> = engine
                .vms_named(name)
                .into_iter()
                .filter_map(|n| attached.iter().find(|a| a.0 == n).copied())
                .collect();
            if named.iter().filter(|n| n.1 == pid).count() != 1 {
                continue;
            }
            if named.len() > 1 {
                tracing::warn!(vm = %id, name, pid, guests = named.len(), "guest name shared by other QEMUs' guests: each is asked only on a socket its own QEMU serves");
            }
            let path = self.dir.join(format!("{name}.sock"));
            if !is_socket(&path) {
                continue;
            }
            let Some(ram) = engine.ram_bytes(id) else {
                continue;
            };
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, flag, interval) = (self.tx.clone(), Arc::clone(&stop), self.interval);
            let layouts = Arc::clone(&self.layouts);
            let guest = ChannelGuest {
                id,
                pid,
                ram_pages: ram / 4096,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("guest-{name}"))
                .spawn(move || channel_thread(guest, &path, &layouts, interval, &flag, &tx));
            if let Err(e) = spawned {
                tracing::warn!("guest channel of {name}: no thread: {e}");
                continue;
            }
            tracing::info!(vm = %id, name, "enlightened guest: asking for page categories");
            self.channels.insert(id, Channel::new(name, pid, stop));
        }
    }

    /// Applies the reports that came to the engine.
    pub fn apply(&mut self, engine: &mut Engine) {
        while let Ok((id, asked, took, r)) = self.rx.try_recv() {
            let Some(c) = self.channels.get_mut(&id) else {
                continue;
            };
            if let Ok(rep) = &r {
                c.answered += 1;
                c.answer_total += took;
                c.answer_max = c.answer_max.max(took);
                if rep.walk_us > 0 {
                    // Told by the guest: no walk outlasts the answer it is part of.
                    let walk_us = rep.walk_us.min(took.as_micros() as u64);
                    c.walked += 1;
                    c.walk_total_us = c.walk_total_us.saturating_add(walk_us);
                }
            }
            match r.map(|mut rep| {
                // The map moves to the engine; the report keeps an empty one.
                let map = std::mem::replace(&mut rep.map, CategoryMapBuilder::new(0).finish());
                let applied = engine.guest_category_map(id, map);
                if applied.is_ok() {
                    // INVARIANT (free-page discard): a report names a round only if it
                    // was asked for after memfoldd learned that round was armed.
                    let after = c.armed.filter(|&(_, at)| asked > at).map(|(r, _)| r);
                    engine.discard_free(id, after, discards_allowed(&rep));
                }
                (rep, applied)
            }) {
                Ok((rep, Ok(_))) => {
                    c.last = Some((rep.layout, rep.meminfo, rep.agent));
                    c.last_error = None;
                }
                Ok((_, Err(e))) => c.failed(e.to_string(), false),
                Err(e @ ReportError::Wire(_)) => c.failed(e.to_string(), true),
                Err(e) => c.failed(e.to_string(), false),
            }
        }
    }

    /// An agent answered a free-page watch of guest `id`: if that armed a round, the
    /// instant is noted (reports asked for after it may discard the round's pages).
    pub fn watch_answered(&mut self, engine: &Engine, id: VmId) {
        let (Some(c), Some(round)) = (self.channels.get_mut(&id), engine.watch_armed(id)) else {
            return;
        };
        if c.armed.map(|a| a.0) != Some(round) {
            c.armed = Some((round, Instant::now()));
        }
    }

    /// Fills the channel's part of guest `stats` (matched by name and QEMU pid: a guest
    /// of the same name attached later by another QEMU, another tenant's perhaps, gets
    /// none of this guest's report).
    pub fn fill(&self, stats: &mut [memfold_wire::VmStats]) {
        for c in self.channels.values() {
            for s in stats
                .iter_mut()
                .filter(|s| s.name == c.name && s.pid == c.pid)
            {
                let g = s.guest_pages.get_or_insert_with(GuestPages::default);
                g.refused += c.refused;
                g.channel_errors = c.channel_errors;
                g.last_error = c.last_error.clone();
                if c.answered > 0 {
                    g.report_ms = c.answer_total.as_secs_f64() * 1e3 / f64::from(c.answered);
                    g.report_max_ms = c.answer_max.as_secs_f64() * 1e3;
                }
                if c.walked > 0 {
                    g.walk_ms = c.walk_total_us as f64 / 1e3 / f64::from(c.walked);
                }
                if let Some((layout, meminfo, agent)) = &c.last {
                    g.low_pages = layout.low;
                    g.high_pages = layout.high;
                    g.layout_exact = layout.exact;
                    g.meminfo = *meminfo;
                    g.agent = agent.clone();
                }
            }
        }
    }

    /// Stops every channel's thread (each ends within about a second, wherever it waits).
    pub fn stop_all(&mut self) {
        for c in self.channels.values() {
            c.stop.store(true, Ordering::Relaxed);
        }
        self.channels.clear();
    }
}

impl Channel {
    /// The channel of guest `name` of QEMU `pid`, its thread stopped by `stop`; nothing
    /// said yet.
    fn new(name: &str, pid: u32, stop: Arc<AtomicBool>) -> Channel {
        Channel {
            name: name.to_string(),
            pid,
            stop,
            last: None,
            last_error: None,
            refused: 0,
            channel_errors: 0,
            armed: None,
            answered: 0,
            answer_total: Duration::ZERO,
            answer_max: Duration::ZERO,
            walked: 0,
            walk_total_us: 0,
        }
    }

    /// A report failed: the channel (`channel`: not answered in time, closed, a line
    /// not of the protocol) or its content (refused).
    fn failed(&mut self, e: String, channel: bool) {
        let n = if channel {
            &mut self.channel_errors
        } else {
            &mut self.refused
        };
        *n += 1;
        let e = shown(&e);
        if n.is_power_of_two() {
            tracing::warn!(name = %self.name, "guest channel: {e}");
        }
        self.last_error = Some(e);
    }
}

fn is_socket(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// The guest a channel thread asks: its engine id, its QEMU's pid, its RAM's pages.
#[derive(Clone, Copy)]
struct ChannelGuest {
    id: VmId,
    pid: u32,
    ram_pages: u64,
}

/// A channel thread's first request number: random (below 2^53, exact in any JSON
/// reader), so that an answer still under way to an earlier channel of the guest
/// (memfoldd restarted, the guest re-attached) carries another number than this
/// channel's requests and is skipped, never taken as the answer to one (free-page
/// discard: a report must be sampled after its request).
fn first_seq() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // Seeded from the OS's randomness once per thread; the time tells threads apart too.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map_or(0, |d| d.as_nanos()));
    h.finish() >> 11
}

/// How often a channel without QEMU's layout asks for it again.
const LAYOUT_RETRY: Duration = Duration::from_secs(60);

/// One guest's channel: connect, ask every `interval`, send each report (or why it
/// failed) to the main loop; reconnect after a channel error; end when `stop` is set or
/// the main loop is gone — within about a second, wherever it waits (its QEMU's monitor
/// included). Frames map to gfns by QEMU's layout when its monitor gives one (asked at
/// most every [`LAYOUT_RETRY`] until it does), else by the guest's ranges.
fn channel_thread(
    guest: ChannelGuest,
    path: &Path,
    layouts: &QemuLayouts,
    interval: Duration,
    stop: &Arc<AtomicBool>,
    tx: &mpsc::Sender<Sent>,
) {
    let mut seq = first_seq();
    let nap = |d: Duration| {
        let until = std::time::Instant::now() + d;
        while std::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100).min(d));
        }
    };
    let mut qemu: Option<RamLayout> = None;
    let mut asked_layout: Option<Instant> = None;
    let mut said: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        // Never a blocking connect: a listener that never accepts (its backlog full)
        // would hold this thread past `stop`, and each re-attach would leave another.
        let Ok(stream) = memfold_sys::socket::connect_stream_at_once(path) else {
            nap(interval);
            continue;
        };
        // *Invariant: memfoldd asks only the guest's own QEMU.* The path's name is the
        // agent's word (its guest's name), which any QEMU may claim before the guest that
        // owns it attaches: the kernel says who made the listening socket, as for the
        // monitor ([`memfold_vm::qmp::Qmp::connect_served_by`]). Another guest's reports
        // would be booked as this one's, and that guest would lose its channel.
        use std::os::fd::AsFd;
        let found = memfold_sys::socket::peer_of(stream.as_fd())
            .ok()
            .map(|p| p.pid);
        if found != Some(guest.pid) {
            drop(stream);
            let r = Err(ReportError::WrongServer {
                path: path.display().to_string(),
                expected: guest.pid,
                found,
            });
            if tx
                .send((guest.id, Instant::now(), Duration::ZERO, r))
                .is_err()
            {
                return;
            }
            nap(interval);
            continue;
        }
        let _ = stream.set_write_timeout(Some(REPORT_TIMEOUT));
        let Ok(mut out) = stream.try_clone() else {
            nap(interval);
            continue;
        };
        // A report must come whole by its deadline, however its bytes trickle in; a
        // reader told to stop stops within a second.
        let timed = DeadlineReader::new(
            stream,
            Instant::now() + report_timeout(guest.ram_pages),
            Some(Arc::clone(stop)),
            Duration::from_secs(1),
        );
        let mut lines = LineReader::new(BufReader::with_capacity(1 << 16, timed));
        while !stop.load(Ordering::Relaxed) {
            if qemu.is_none() && asked_layout.is_none_or(|t| t.elapsed() >= LAYOUT_RETRY) {
                asked_layout = Some(Instant::now());
                // The monitor is the QEMU's: its waits end when this thread is told to
                // stop, or each re-attach would leave one more thread held there.
                let got = layouts.layout(guest.pid, guest.ram_pages, stop);
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                match got {
                    Ok(l) => qemu = Some(l),
                    Err(why) => {
                        // It may quote QEMU's error text: escaped and short in the log.
                        let why = crate::monitor::said(&why);
                        if said.as_ref() != Some(&why) {
                            tracing::info!(vm = %guest.id, "no RAM layout from QEMU ({why}): inferred from the guest's ranges");
                            said = Some(why);
                        }
                    }
                }
            }
            seq += 1;
            let asked = Instant::now();
            lines.get_mut().get_mut().until = asked + report_timeout(guest.ram_pages);
            let r = read_report(&mut lines, &mut out, seq, guest.ram_pages, qemu);
            let took = asked.elapsed();
            let drop_channel = matches!(r, Err(ReportError::Wire(_)));
            if tx.send((guest.id, asked, took, r)).is_err() {
                return;
            }
            if drop_channel {
                break;
            }
            nap(interval);
        }
        nap(interval);
    }
}

#[cfg(test)]
mod tests;
