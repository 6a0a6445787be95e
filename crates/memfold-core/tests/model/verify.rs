//! The checks after every step, and the teardown's.

use memfold_core::backing::Backing;
use memfold_core::engine::Books;
use memfold_core::ids::Gfn;
use memfold_core::p2m::PageState;
use memfold_core::sim::Home;

use super::{flipped, reads_right, Harness, ANY_FRAME};

impl Harness {
    /// Every page reads as the model says; the engine's invariants hold; every frame and
    /// blob an agent relies on is held by the engine; no error without its fault; the
    /// books of each guest whose answers and events are all in agree with its agent.
    pub fn verify_all(&self) -> Result<(), String> {
        let _reads = self.engine_faults.quiet();
        self.engine.check_invariants()?;
        let books = self.engine.books();
        self.no_errors(&books)?;
        // No leak: each pool, store and swap file holds exactly what the books hold.
        let held = books.held;
        for (what, (h, b)) in ["pools", "stores", "swap files"].iter().zip(held) {
            if h != b {
                return Err(format!("the {what} hold {h} bytes, the books {b}"));
            }
        }
        // The pool counts exactly the live QEMUs' present PTEs onto its frames (what
        // `MADV_PAGEOUT` reads; an exited QEMU's went with it).
        for (d, pool) in &self.pools {
            let counted: u64 = pool.file().mapped.values().map(|&n| u64::from(n)).sum();
            let ptes: u64 = (self.vms.iter())
                .filter(|v| self.domain_of(v) == *d)
                .map(|v| v.agent.frame_ptes())
                .sum();
            if counted != ptes {
                return Err(format!(
                    "the pool of {d} counts {counted} mapped pages, its guests map {ptes}"
                ));
            }
        }
        for (i, v) in self.vms.iter().enumerate() {
            for g in 0..v.agent.pages() {
                let g = Gfn(g);
                match v.agent.peek(g) {
                    Ok(got) if !reads_right(v, g, &got) => {
                        return Err(format!(
                            "vm {i} {g} ({:?}): reads bytes the guest did not write",
                            v.agent.home(g)
                        ));
                    }
                    Ok(_) => {}
                    // Its blob corrupted: it fails closed. Its books are checked still.
                    Err(_) if flipped(v, g) => {}
                    Err(e) => return Err(format!("vm {i} {g}: {e}")),
                }
                match v.agent.home(g) {
                    Home::Frame(f) => {
                        if !self.engine.frame_held(self.domain_of(v), f) {
                            return Err(format!("vm {i} {g} maps {f}, which the engine freed"));
                        }
                        if let Some(allowed) = v.marked[g.index()].as_ref().filter(|_| v.connected)
                        {
                            // Never-share (Satori §4.3): no share after the mark.
                            if !allowed.contains(&f) {
                                return Err(format!(
                                    "vm {i} {g}: marked never-share, yet mapped onto {f} (before the mark: {allowed:?})"
                                ));
                            }
                        }
                        if let Some(id) = v.id.filter(|_| v.connected) {
                            let s = self.engine.page_state(id, g);
                            if !matches!(s, Some(PageState::Shared(x) | PageState::Sharing(x)) if x == f)
                            {
                                return Err(format!("vm {i} {g} maps {f}, the engine says {s:?}"));
                            }
                        }
                    }
                    Home::Stashed(st) => {
                        // A patch's reference page is held while the patch is.
                        if let Some(f) = st.reference {
                            if !self.engine.frame_held(self.domain_of(v), f) {
                                return Err(format!(
                                    "vm {i} {g} is a patch against {f}, which the engine freed"
                                ));
                            }
                        }
                        // Never-share: neither patched against a frame nor unmapped onto one
                        // after the mark.
                        let marked = v.marked[g.index()].as_ref().filter(|_| v.connected);
                        if let (Some(f), Some(a)) = (st.reference, marked) {
                            if !a.contains(&f) && !a.contains(&ANY_FRAME) {
                                return Err(format!(
                                    "vm {i} {g}: marked never-share, yet stashed against {f} ({st:?}; before the mark: {a:?})"
                                ));
                            }
                        }
                        if let Some(id) = v.id.filter(|_| v.connected) {
                            let s = self.engine.page_state(id, g);
                            if let Some(PageState::Unmapped(f)) = s {
                                // Shared without a mapping: the agent holds the empty
                                // patch against that very frame, nothing else.
                                if st.reference != Some(f) || st.len != 0 {
                                    return Err(format!(
                                        "vm {i} {g} is unmapped onto {f}, but the agent holds {st:?}"
                                    ));
                                }
                            } else if !matches!(
                                s,
                                Some(
                                    PageState::Stored(_)
                                        | PageState::Stashing(_)
                                        | PageState::Moving(_)
                                )
                            ) {
                                return Err(format!(
                                    "vm {i} {g} is stashed, the engine says {s:?}"
                                ));
                            }
                        }
                    }
                    Home::Zero | Home::Private => {}
                }
            }
        }
        self.books_agree_now()
    }

    /// Drains every wire, re-attaches everyone, removes every guest: nothing may remain.
    pub fn teardown(mut self) -> Result<(), String> {
        // The invariant check reads the pool through the engine's handles.
        let faults = self.engine_faults.clone();
        let _reads = faults.quiet();
        let mut i = 0;
        while i < self.vms.len() {
            if !self.vms[i].connected {
                let n = self.vms.len();
                self.attach(i)?;
                if self.vms.len() < n {
                    continue; // failed closed and removed
                }
            }
            self.answer_held(i)?;
            while let Some(cmd) = self.vms[i].wire.pop_front() {
                let o = self.vms[i].agent.execute(&cmd);
                self.answer(i, &cmd, o)?;
            }
            self.report(i);
            i += 1;
        }
        self.verify_all()?;
        for (i, v) in self.vms.iter().enumerate() {
            self.books_agree_with_agent(i, v)?;
        }
        for mut v in std::mem::take(&mut self.vms) {
            v.agent.exit();
            self.engine.remove(v.id.expect("attached"));
        }
        for &d in self.pools.keys() {
            self.engine.end_adoption(d);
        }
        self.engine.check_invariants()?;
        let b = self.engine.books();
        if b.frames != 0 || b.store_pages != 0 || b.swap.file_pages != 0 || b.domains != 0 {
            return Err(format!("leak after teardown: {b:?}"));
        }
        for (d, pool) in &self.pools {
            let mapped = pool.file().mapped.len();
            if mapped != 0 {
                return Err(format!(
                    "{mapped} frames of the pool of {d} still mapped after every QEMU exited"
                ));
            }
            if pool.allocated_bytes() != 0 {
                return Err(format!(
                    "{} bytes of the pool of {d} still allocated after teardown",
                    pool.allocated_bytes()
                ));
            }
        }
        Ok(())
    }

    /// Whether a fault that causes them is injected now: [pool errors, blob write errors].
    fn errors_excused(&self) -> [bool; 2] {
        let (f, e) = (self.faults, &self.engine_faults);
        [
            // A share's check reads the pool too.
            f[0] || e.resize_failing() || e.reads_failing(),
            f[1] || f[2] || e.resize_failing(),
        ]
    }

    /// Notes the faults injected now (before and after each step), for
    /// [`Harness::no_errors`].
    pub(super) fn note_faults(&self) {
        let (n, mut excused) = self.errors.get();
        for (x, now) in excused.iter_mut().zip(self.errors_excused()) {
            *x |= now;
        }
        self.errors.set((n, excused));
    }

    /// No pool or blob write error since the last check unless a fault that causes it
    /// was injected meanwhile: a fault that clears leaves nothing behind (the pool grows
    /// again, the stores take blobs again; a frame table left grown past its pool fails
    /// every share after).
    fn no_errors(&self, books: &Books) -> Result<(), String> {
        let (was, excused) = self.errors.get();
        let now = [books.pool_errors, books.blob_write_errors];
        self.errors.set((now, self.errors_excused()));
        for (k, what) in ["pool errors", "blob write errors"].iter().enumerate() {
            // A restart's engine counts from 0.
            let new = now[k].checked_sub(was[k]).unwrap_or(now[k]);
            if new > 0 && !excused[k] {
                return Err(format!(
                    "{new} {what} with no fault injected since the last check"
                ));
            }
        }
        Ok(())
    }
}
