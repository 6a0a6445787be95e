//! A wait target per guest (issue 15, "the lever not yet built"; `--wait-target PCT`):
//! Senpai's rule — raise the pressure while the workload's stall is under a target,
//! ease it while over — applied to memfold's own cost. A guest pays for what the
//! Difference Engine stores (DE §4.2–4.4) when it touches the page again: a missing
//! fault and a decode, with its thread waiting on the agent. The guest's agent reports
//! that wait (µs summed over its threads, cumulative: CoW breaks, missing faults, the
//! clock's faults, decodes); memfoldd hands it in each second ([`Engine::guest_waited`]).
//!
//! Every [`WAIT_WINDOW_US`], the guest's wait share is its waits over the window's wall
//! time. Over the target, its *store floor* rises by one idle clock scan (to at most
//! [`STORE_FLOOR_MAX`], where it stores nothing new); after [`CALM_WINDOWS`] windows in a
//! row under half the target, it falls by one. A page is patched,
//! compressed, or shared without a mapping only once it has been idle for the floor's
//! clock scans, besides its policy class and its own re-store back-off — so a guest
//! whose warm pages keep coming back keeps more of them in RAM, and a guest that waits
//! little gives up its colder pages as before.
//!
//! At the top the guest's NRU clock rests too: nothing new is stored, so its classes are
//! not needed, and its R/M faults — measured, the larger part of a database guest's
//! waits — stop once each page armed before has faulted once. The classes stay as they
//! were until the floor comes down and the clock goes on where it stopped. Over the host
//! budget (swap wanted) the clock runs whatever the floor.
//!
//! What it does not touch: what is already stored stays (it comes back on its next
//! access, as always); swap over the host budget (DE §4.6) ignores the floor — a host
//! short of memory comes before a guest's waits; correctness — the floor only delays
//! stores.

use crate::ids::VmId;

use super::Engine;

/// How long a wait share is measured over, µs.
pub const WAIT_WINDOW_US: u64 = 10_000_000;

/// Windows in a row under half the target before the floor comes down a scan. Faster,
/// and a guest whose clock rests at the top (its waits near 0) swings back at once: the
/// clock's first pass re-arms every page it uses, a wave of faults (measured: db's waits
/// 0.3% at the top, 5% a window after).
pub const CALM_WINDOWS: u8 = 3;

/// The highest store floor, idle clock scans. The clock counts a page's idle scans up to
/// 7, so at 8 nothing new is stored at all: a floor of 7 delays a store by 28 s at the
/// default 4 s clock, which a workload that comes back every minute or so (pgbench's
/// rounds) outlasts, its pages stored and decoded each round all the same.
pub const STORE_FLOOR_MAX: u8 = 8;

/// A guest's wait controller.
#[derive(Clone, Debug, Default)]
pub(crate) struct WaitControl {
    /// Idle clock scans a page needs before it is stored.
    pub(crate) floor: u8,
    /// Start of the current window: (when, µs; the guest's waits then, µs).
    window: Option<(u64, u64)>,
    /// The last window's wait share, percent.
    pub(crate) share_pct: Option<f64>,
    /// Windows in a row under half the target.
    calm: u8,
}

impl Engine {
    /// Guest `id`'s agent says its threads have waited `wait_us` µs on it in all
    /// (cumulative since the agent connected; a smaller number than before starts
    /// over). With a wait target ([`crate::EngineConfig::wait_target_pct`]) this moves
    /// the guest's store floor at the end of each [`WAIT_WINDOW_US`]; without one it
    /// does nothing. An unknown guest is ignored.
    pub fn guest_waited(&mut self, id: VmId, wait_us: u64) {
        let Some(target) = self.cfg.wait_target_pct else {
            return;
        };
        let now = self.now_us();
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let w = &mut v.wait;
        let Some((at, before)) = w.window.filter(|&(_, before)| wait_us >= before) else {
            w.window = Some((now, wait_us));
            return;
        };
        let span = now.saturating_sub(at);
        if span < WAIT_WINDOW_US {
            return;
        }
        let share = (wait_us - before) as f64 * 100.0 / span as f64;
        w.share_pct = Some(share);
        w.window = Some((now, wait_us));
        if share > target {
            w.calm = 0;
            if w.floor < STORE_FLOOR_MAX {
                w.floor += 1;
                v.books.store_floor_raised += 1;
            }
        } else if share < target / 2.0 {
            w.calm = w.calm.saturating_add(1);
            if w.calm >= CALM_WINDOWS && w.floor > 0 {
                w.floor -= 1;
                w.calm = 0;
            }
        } else {
            w.calm = 0;
        }
    }

    /// Guest `id`'s store floor (idle clock scans) and its last wait share (percent;
    /// `None` before a whole window); `None` for an unknown guest.
    pub fn store_floor(&self, id: VmId) -> Option<(u8, Option<f64>)> {
        self.vms.get(&id).map(|v| (v.wait.floor, v.wait.share_pct))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Gfn;
    use crate::p2m::PageState;
    use crate::sim::{quick_config, Rig};
    use crate::{EngineConfig, Policy, PAGE_SIZE};

    const PAGES: u32 = 32;

    fn rig(target: Option<f64>) -> Rig {
        let cfg = EngineConfig {
            wait_target_pct: target,
            ..quick_config(Policy::difference_engine())
        };
        Rig::new(cfg, PAGES).unwrap()
    }

    /// Text unique to page `g`: compresses well, equal to no other page.
    fn text(g: u32) -> Vec<u8> {
        let line = format!("page {g}: a line of text that a guest keeps in its page cache. ");
        line.bytes().cycle().take(PAGE_SIZE).collect()
    }

    /// `ms` of memfoldd, 10 ms a step.
    fn run(r: &mut Rig, ms: u64) {
        for _ in 0..ms / 10 {
            r.step(10_000).unwrap();
        }
        r.engine.check_invariants().unwrap();
    }

    fn stored(r: &Rig) -> usize {
        (0..PAGES)
            .filter(|&g| {
                matches!(
                    r.engine.page_state(r.vm, Gfn(g)),
                    Some(PageState::Stored(_))
                )
            })
            .count()
    }

    /// `windows` whole windows in which the guest waits `pct` percent of the time.
    fn wait(r: &mut Rig, windows: u64, pct: u64) {
        let mut total = r.engine.vms[&r.vm].wait.window.map_or(0, |w| w.1);
        r.engine.guest_waited(r.vm, total);
        for _ in 0..windows {
            r.clock.advance(WAIT_WINDOW_US);
            total += WAIT_WINDOW_US * pct / 100;
            r.engine.guest_waited(r.vm, total);
        }
    }

    /// Over the target the floor rises a scan per window, and a page idle for fewer scans
    /// than the floor is not stored, where a guest without a target has it stored; under
    /// half the target the floor falls back and the pages are stored.
    #[test]
    fn a_guest_that_waits_over_its_target_gets_fewer_pages_stored() {
        let mut held = rig(Some(2.0));
        let mut free = rig(None);
        wait(&mut held, 10, 5);
        let (floor, share) = held.engine.store_floor(held.vm).unwrap();
        assert_eq!(floor, STORE_FLOOR_MAX, "8 raises, then held at the top");
        assert!((share.unwrap() - 5.0).abs() < 1e-9, "{share:?}");
        assert_eq!(held.engine.books().vms[0].books.store_floor_raised, 8);
        assert_eq!(held.engine.books().vms[0].books.wait_share_bp, Some(500));
        for r in [&mut held, &mut free] {
            for g in 0..PAGES {
                r.agent.write(Gfn(g), 0, &text(g)).unwrap();
            }
            run(r, 500);
        }
        assert!(
            stored(&free) >= PAGES as usize / 2,
            "without a target, cold text is stored: {}",
            stored(&free)
        );
        assert_eq!(stored(&held), 0, "5 clock scans, floor 8: nothing stored");
        // At the top nothing is stored however long the pages stay idle (the clock
        // counts to 7).
        run(&mut held, 1500);
        assert_eq!(stored(&held), 0, "15 clock scans, floor 8: nothing stored");

        // The waits stop: the floor falls a scan per 3 windows (0% < 1%), then the pages go.
        wait(&mut held, 2, 0);
        assert_eq!(held.engine.store_floor(held.vm).unwrap().0, STORE_FLOOR_MAX);
        wait(&mut held, 1, 0);
        assert_eq!(
            held.engine.store_floor(held.vm).unwrap().0,
            STORE_FLOOR_MAX - 1
        );
        wait(&mut held, 7 * CALM_WINDOWS as u64, 0);
        assert_eq!(held.engine.store_floor(held.vm).unwrap().0, 0);
        run(&mut held, 500);
        assert!(stored(&held) >= PAGES as usize / 2, "{}", stored(&held));
        for g in 0..PAGES {
            assert_eq!(held.agent.peek(Gfn(g)).unwrap().to_vec(), text(g));
        }
    }

    /// At the top the guest's clock rests — no slice is asked for, so no page is armed
    /// and no R/M fault taken — and goes on once the floor comes down; over the host
    /// budget it runs whatever the floor.
    #[test]
    fn at_the_top_the_clock_rests_unless_swap_is_wanted() {
        use crate::engine::Command;
        let mut r = rig(Some(2.0));
        let slices = |r: &mut Rig| {
            r.clock.advance(200_000);
            r.engine.clock_step();
            r.engine
                .take_commands(r.vm)
                .iter()
                .filter(|c| matches!(c, Command::ClockScan { .. }))
                .count()
        };
        assert_eq!(slices(&mut r), 1);
        wait(&mut r, 8, 5);
        assert_eq!(r.engine.store_floor(r.vm).unwrap().0, STORE_FLOOR_MAX);
        assert_eq!(slices(&mut r), 0, "the clock rests");
        r.engine.budget.swap_wanted = 1;
        assert_eq!(slices(&mut r), 1, "swap needs the classes");
        r.engine.budget.swap_wanted = 0;
        wait(&mut r, CALM_WINDOWS as u64, 0);
        assert_eq!(slices(&mut r), 1, "floor 7: the clock goes on");
    }

    /// Between half the target and the target the floor stays; swap over the host budget
    /// is not held back (checked in `de_page`: the floor is 0 while swap is wanted).
    #[test]
    fn between_half_and_the_target_the_floor_holds() {
        let mut r = rig(Some(4.0));
        wait(&mut r, 2, 5);
        assert_eq!(r.engine.store_floor(r.vm).unwrap().0, 2);
        wait(&mut r, 3, 3);
        assert_eq!(r.engine.store_floor(r.vm).unwrap().0, 2, "3% in [2%, 4%]");
        wait(&mut r, 2, 1);
        wait(&mut r, 1, 3);
        wait(&mut r, 2, 1);
        assert_eq!(
            r.engine.store_floor(r.vm).unwrap().0,
            2,
            "calm windows must be in a row"
        );
        wait(&mut r, 1, 1);
        assert_eq!(r.engine.store_floor(r.vm).unwrap().0, 1);
    }

    /// Without a target nothing moves; an agent that starts over (a smaller count)
    /// starts a new window rather than closing one on a negative wait.
    #[test]
    fn without_a_target_or_across_a_new_agent_the_floor_stays() {
        let mut r = rig(None);
        wait(&mut r, 3, 50);
        assert_eq!(r.engine.store_floor(r.vm).unwrap(), (0, None));

        let mut r = rig(Some(2.0));
        r.engine.guest_waited(r.vm, 1_000_000);
        r.clock.advance(WAIT_WINDOW_US);
        r.engine.guest_waited(r.vm, 500);
        assert_eq!(r.engine.store_floor(r.vm).unwrap(), (0, None));
        r.clock.advance(WAIT_WINDOW_US);
        r.engine.guest_waited(r.vm, 500 + WAIT_WINDOW_US / 10);
        assert_eq!(r.engine.store_floor(r.vm).unwrap().0, 1);
    }

    #[test]
    fn a_target_outside_0_to_100_percent_is_refused() {
        for bad in [0.0, -1.0, 100.0, f64::NAN] {
            let cfg = EngineConfig {
                wait_target_pct: Some(bad),
                ..EngineConfig::default()
            };
            assert!(cfg.validate().is_err(), "{bad}");
        }
    }
}
