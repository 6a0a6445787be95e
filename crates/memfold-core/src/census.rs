//! A census of guest memory by content: the sharing potential at one instant (Satori
//! §6.1 measures the sharing a system captured against "the total sharing potential",
//! taken from memory snapshots at the same instants). Every page counts once, by its
//! content: a page shared onto a frame counts as the frame's content, a reclaimed page
//! as zeros. The potential is what sharing every duplicate would save: for each distinct
//! non-zero content held by n pages, n − 1 pages; zero pages are counted apart (a zero
//! page needs no frame at all).
//!
//! [`Census`] is filled by whoever can read the pages: the engine for the guests it
//! manages ([`crate::Engine::census`]), a reader of `/proc/PID/mem` for guests under KSM.

use hashbrown::HashMap;

use crate::{is_zero_page, page_hash, Page};

/// Guest pages by content at one instant (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Census {
    /// Pages counted.
    pub pages: u64,
    /// Of those, zero pages (including pages never written, which read as zeros).
    pub zero_pages: u64,
    /// Pages whose content could not be told without decoding (stored: patched,
    /// compressed, swapped), counted in [`Census::pages`] only.
    pub unknown_pages: u64,
    /// Pages per distinct non-zero content hash (xxh3-64, [`page_hash`]).
    counts: HashMap<u64, u32>,
}

impl Census {
    /// An empty census.
    pub fn new() -> Census {
        Census::default()
    }

    /// Counts one page of content `page`.
    pub fn add_page(&mut self, page: &Page) {
        if is_zero_page(page) {
            self.add_zero();
        } else {
            self.add_hash(page_hash(page));
        }
    }

    /// Counts one non-zero page whose content hashes to `hash` ([`page_hash`]).
    pub fn add_hash(&mut self, hash: u64) {
        self.pages += 1;
        *self.counts.entry(hash).or_default() += 1;
    }

    /// Counts one zero page.
    pub fn add_zero(&mut self) {
        self.pages += 1;
        self.zero_pages += 1;
    }

    /// Counts one page whose content is not known.
    pub fn add_unknown(&mut self) {
        self.pages += 1;
        self.unknown_pages += 1;
    }

    /// Distinct non-zero contents.
    pub fn distinct(&self) -> u64 {
        self.counts.len() as u64
    }

    /// The sharing potential, pages: for each distinct non-zero content held by n
    /// pages, n − 1 (what one frame per content would save).
    pub fn duplicate_pages(&self) -> u64 {
        self.counts.values().map(|&n| n as u64 - 1).sum()
    }

    /// Non-zero pages whose content some other page also holds, pages.
    pub fn duplicated_pages(&self) -> u64 {
        self.counts
            .values()
            .filter(|&&n| n > 1)
            .map(|&n| n as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PAGE_SIZE;

    fn page(b: u8) -> Box<Page> {
        Box::new([b; PAGE_SIZE])
    }

    #[test]
    fn duplicates_are_copies_beyond_the_first_and_zeros_apart() {
        let mut c = Census::new();
        for b in [1, 1, 1, 2, 2, 3, 0, 0] {
            c.add_page(&page(b));
        }
        c.add_unknown();
        assert_eq!(c.pages, 9);
        assert_eq!((c.zero_pages, c.unknown_pages), (2, 1));
        assert_eq!(c.distinct(), 3);
        assert_eq!(c.duplicate_pages(), 3, "two more 1s, one more 2");
        assert_eq!(c.duplicated_pages(), 5);
        // A shared page counts as its frame's content.
        c.add_hash(page_hash(&page(3)));
        assert_eq!(c.duplicate_pages(), 4);
    }
}
