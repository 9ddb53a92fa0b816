//! A KV pool: one KV cache whose positions are shared out in fixed-size pages to many sequences.
//!
//! The cache keeps the layout of a session's ([`super::KvLayout`]: slot-major, a slot per
//! (stage, block, iteration)); its capacity counts pool positions instead of the positions of one
//! sequence. A page is `page_size` consecutive pool positions in every slot, so a sequence's page
//! table maps its positions to pool positions for all its block applications at once, and
//! running more loop iterations adds slots to the pool, not pages to a sequence.
//!
//! Pages of prompt prefixes are shared. A page whose positions all hold prompt tokens is
//! registered under its prefix: the loop count and every token from position 0 to the page's
//! end, compared whole (no hash stands in for the tokens). A later sequence with the same
//! prefix at the same loops takes the page instead of computing it again (the entries are the
//! same: they depend only on the tokens before them and the loop count). A page is held by
//! reference count; a registered page that nobody holds stays cached until its memory is
//! needed, oldest first.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};

/// What a registered page holds: the loop count and the prompt tokens from position 0 to the
/// page's end.
pub type PrefixKey = (usize, Vec<u32>);

/// The pages of a pool: who holds them, and which cached prefixes they keep.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    pages: usize,
    /// Pages that hold nothing, the lowest last (handed out first).
    free: Vec<u32>,
    /// Holders of each page.
    holders: Vec<u32>,
    /// Registered pages by prefix, and each page's prefix.
    cached: HashMap<PrefixKey, u32>,
    keys: Vec<Option<PrefixKey>>,
    /// Registered pages that nobody holds, least recently released first.
    idle: VecDeque<u32>,
}

impl PagePool {
    /// A pool of `pages` pages of `page_size` positions.
    pub fn new(page_size: usize, pages: usize) -> Result<PagePool> {
        if page_size == 0 || pages == 0 {
            return Err(Error::invalid(format!(
                "a KV pool needs pages of at least one position and at least one page \
                 (got {pages} pages of {page_size})"
            )));
        }
        if u32::try_from(pages).is_err() {
            return Err(Error::invalid(format!(
                "a KV pool of {pages} pages (at most {})",
                u32::MAX
            )));
        }
        Ok(PagePool {
            page_size,
            pages,
            free: (0..pages as u32).rev().collect(),
            holders: vec![0; pages],
            cached: HashMap::new(),
            keys: vec![None; pages],
            idle: VecDeque::new(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Pages nobody holds (free, or cached and idle).
    pub fn free_pages(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Registered pages nobody holds.
    pub fn cached_pages(&self) -> usize {
        self.idle.len()
    }

    /// Pages a sequence of `positions` positions needs.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_size)
    }

    /// Hold the page registered under `key`, if there is one.
    pub fn share(&mut self, key: &PrefixKey) -> Option<u32> {
        let page = *self.cached.get(key)?;
        if self.holders[page as usize] == 0 {
            self.idle.retain(|&p| p != page);
        }
        self.holders[page as usize] += 1;
        Some(page)
    }

    /// Give `table` pages until it holds `positions` positions (free pages first, then the
    /// least recently used cached ones); false, and nothing taken, when too few are free.
    pub fn grow(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let needed = self.pages_for(positions).saturating_sub(table.len());
        if needed > self.free_pages() {
            return false;
        }
        for _ in 0..needed {
            if let Some(page) = self.take_page() {
                self.holders[page as usize] = 1;
                table.push(page);
            }
        }
        true
    }

    /// A free page, or else the least recently used cached one (its prefix forgotten).
    fn take_page(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            let page = self.idle.pop_front()?;
            if let Some(key) = self.keys[page as usize].take() {
                self.cached.remove(&key);
            }
            Some(page)
        })
    }

    /// Register `page` (held, its positions all written with `key`'s last tokens) under `key`,
    /// unless another page holds that prefix already or the page is registered.
    pub fn register(&mut self, page: u32, key: PrefixKey) {
        if self.keys[page as usize].is_none() && !self.cached.contains_key(&key) {
            self.cached.insert(key.clone(), page);
            self.keys[page as usize] = Some(key);
        }
    }

    /// Let go of every page of `table`: a page nobody holds any more is freed, or kept cached
    /// when registered.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for page in table.drain(..) {
            let holders = &mut self.holders[page as usize];
            debug_assert!(*holders > 0, "page {page} released more often than held");
            *holders = holders.saturating_sub(1);
            if *holders == 0 {
                if self.keys[page as usize].is_some() {
                    self.idle.push_back(page);
                } else {
                    self.free.push(page);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_and_returned() {
        let mut pool = PagePool::new(16, 4).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.grow(&mut a, 17));
        assert_eq!(a, [0, 1]);
        assert!(
            pool.grow(&mut a, 32),
            "a page already holds positions 16..32"
        );
        assert_eq!(a.len(), 2);
        assert!(pool.grow(&mut b, 1));
        assert_eq!(b, [2]);
        assert!(!pool.grow(&mut b, 33), "three more pages are not free");
        assert_eq!((b.len(), pool.free_pages()), (1, 1));
        pool.release(&mut a);
        assert!(a.is_empty());
        assert_eq!(pool.free_pages(), 3);
        assert!(pool.grow(&mut b, 48));
        assert_eq!(b, [2, 1, 0]);
        pool.release(&mut b);
        assert_eq!(pool.free_pages(), 4);
    }

    #[test]
    fn registered_pages_are_shared_cached_and_evicted_oldest_first() {
        let mut pool = PagePool::new(2, 3).unwrap();
        let key = |loops, tokens: &[u32]| (loops, tokens.to_vec());
        let mut a = Vec::new();
        assert!(pool.grow(&mut a, 5));
        pool.register(a[0], key(4, &[1, 2]));
        pool.register(a[1], key(4, &[1, 2, 3, 4]));
        // Another sequence with the same prefix at the same loops takes the pages.
        let mut b = vec![pool.share(&key(4, &[1, 2])).unwrap()];
        b.push(pool.share(&key(4, &[1, 2, 3, 4])).unwrap());
        assert_eq!(b, a[..2]);
        assert_eq!(
            pool.share(&key(8, &[1, 2])),
            None,
            "other loops: other entries"
        );
        assert_eq!(pool.share(&key(4, &[1, 9])), None);
        pool.release(&mut a);
        assert_eq!(
            (pool.free_pages(), pool.cached_pages()),
            (1, 0),
            "b holds both"
        );
        pool.release(&mut b);
        assert_eq!((pool.free_pages(), pool.cached_pages()), (3, 2));
        // Cached pages come back to a sharer; then they are evicted when memory runs out.
        let mut c = vec![pool.share(&key(4, &[1, 2])).unwrap()];
        assert_eq!(pool.cached_pages(), 1);
        assert!(pool.grow(&mut c, 6));
        assert_eq!(
            pool.share(&key(4, &[1, 2, 3, 4])),
            None,
            "evicted for c's pages"
        );
        assert_eq!(pool.free_pages(), 0);
        pool.release(&mut c);
        assert_eq!((pool.free_pages(), pool.cached_pages()), (3, 1));
    }

    #[test]
    fn empty_pools_are_refused() {
        for (size, pages) in [(0, 4), (16, 0)] {
            let e = PagePool::new(size, pages).unwrap_err().to_string();
            assert!(e.contains("at least one"), "{e}");
        }
    }
}
