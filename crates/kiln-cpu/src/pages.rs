//! Weights on transparent huge pages. A decode step reads every matrix from
//! memory once; on 4 KiB pages those reads miss the TLB every 4 KiB, and a
//! one-thread product read F16 rows at 18 GB/s where the same rows on
//! 2 MiB pages gave 22.4 (docs/models.md). Most systems set THP to
//! `madvise`, so kiln asks for them: [`Pages`] hands out slices of 2 MiB-aligned
//! regions advised `MADV_HUGEPAGE` before anything touches them, a model's
//! matrices packed one after another so that even the small ones share
//! whole huge pages. Where the advice is refused (THP off, another OS) the
//! same memory serves on small pages: it is advice, never a requirement.

use std::ops::Deref;
use std::sync::Arc;

/// A huge page (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Bytes of a region that several matrices share: larger matrices get a
/// region of their own.
const REGION: usize = 32 * HUGE_PAGE;

/// Where a stored slice starts within its region: a cache line.
const ALIGN: usize = 64;

/// One mapping, `len` bytes from `at`, unmapped on drop.
struct Region {
    at: *mut u8,
    len: usize,
}

// SAFETY: a region is written only while its one `Pages` hands out the
// slices being filled (through `&mut`), and read-only after.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// `len` bytes (a multiple of [`HUGE_PAGE`]) at a 2 MiB-aligned
    /// address, advised huge pages; `None` if the system has no memory for
    /// it.
    #[cfg(target_os = "linux")]
    fn new(len: usize) -> Option<Region> {
        debug_assert!(len.is_multiple_of(HUGE_PAGE));
        // Map a huge page more than asked and trim both ends to the
        // alignment: mmap itself only promises 4 KiB.
        let mapped = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base.cast::<u8>();
        let head = (HUGE_PAGE - base as usize % HUGE_PAGE) % HUGE_PAGE;
        let tail = mapped - head - len;
        // SAFETY: both ranges lie inside the mapping just made and are
        // never used; `at` is inside it too. Failures leave memory mapped
        // (a leak of at most 2 MiB), never a wrong mapping.
        unsafe {
            if head > 0 {
                libc::munmap(base.cast(), head);
            }
            let at = base.add(head);
            if tail > 0 {
                libc::munmap(at.add(len).cast(), tail);
            }
            // Before the first touch, so that the faults take huge pages
            // where the system has them. Refusal (THP disabled) is fine.
            libc::madvise(at.cast(), len, libc::MADV_HUGEPAGE);
            Some(Region { at, len })
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn new(len: usize) -> Option<Region> {
        let layout = std::alloc::Layout::from_size_align(len, HUGE_PAGE).ok()?;
        // SAFETY: `len` is not zero (a multiple of HUGE_PAGE, at least one).
        let at = unsafe { std::alloc::alloc(layout) };
        (!at.is_null()).then_some(Region { at, len })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping (or allocation) `new` made, no longer
        // referred to: every `Stored` holds its region alive.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::munmap(self.at.cast(), self.len);
        }
        #[cfg(not(target_os = "linux"))]
        unsafe {
            let layout = std::alloc::Layout::from_size_align_unchecked(self.len, HUGE_PAGE);
            std::alloc::dealloc(self.at, layout);
        }
    }
}

/// Read-only values in a [`Pages`] region (or, where no region could be
/// mapped, on the heap): derefs to `[T]`.
pub struct Stored<T>(Place<T>);

enum Place<T> {
    /// `len` values at `at`, inside `region`, which the slice keeps alive.
    Pages {
        at: *const T,
        len: usize,
        _region: Arc<Region>,
    },
    Heap(Vec<T>),
}

// SAFETY: read-only after it is made; `T` is plain data (`Copy`).
unsafe impl<T: Copy + Sync> Send for Stored<T> {}
unsafe impl<T: Copy + Sync> Sync for Stored<T> {}

impl<T> Deref for Stored<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.0 {
            // SAFETY: `len` initialised values at `at` (written by
            // `Pages::store`), alive as long as the region is.
            Place::Pages { at, len, .. } => unsafe { std::slice::from_raw_parts(*at, *len) },
            Place::Heap(values) => values,
        }
    }
}

impl<T: Copy> Stored<T> {
    /// Values on the heap (small pages): for a matrix made alone.
    pub fn on_heap(values: Vec<T>) -> Stored<T> {
        Stored(Place::Heap(values))
    }

    /// Whether the values lie in a region advised huge pages.
    pub fn in_pages(&self) -> bool {
        matches!(self.0, Place::Pages { .. })
    }
}

/// Hands out slices of huge-page regions, one after another, for the
/// matrices of one model.
#[derive(Default)]
pub struct Pages {
    /// The region being filled and the bytes of it used.
    current: Option<(Arc<Region>, usize)>,
    /// Everything on the heap instead (for measuring what the pages give).
    small: bool,
}

impl Pages {
    pub fn new() -> Pages {
        Pages::default()
    }

    /// Pages that store every slice on the heap, on the system's small
    /// pages: what [`Pages::new`] is measured against.
    pub fn on_small_pages() -> Pages {
        Pages {
            current: None,
            small: true,
        }
    }

    /// `values` (exactly `len` of them) in huge-page memory.
    pub fn store<T: Copy>(&mut self, len: usize, values: impl IntoIterator<Item = T>) -> Stored<T> {
        assert!(std::mem::align_of::<T>() <= ALIGN);
        let bytes = len * std::mem::size_of::<T>();
        let Some((region, offset)) = self.place(bytes) else {
            let heap: Vec<T> = values.into_iter().collect();
            assert_eq!(heap.len(), len, "Pages::store: {len} values promised");
            return Stored::on_heap(heap);
        };
        // SAFETY: `bytes` at `offset` are this slice's alone (`place`
        // moved past them), inside the region, aligned for T.
        let at = unsafe { region.at.add(offset).cast::<T>() };
        let mut values = values.into_iter();
        let mut written = 0;
        for value in values.by_ref().take(len) {
            // SAFETY: written < len: inside the slice's bytes.
            unsafe { at.add(written).write(value) };
            written += 1;
        }
        assert!(
            written == len && values.next().is_none(),
            "Pages::store: {len} values promised"
        );
        Stored(Place::Pages {
            at,
            len,
            _region: region,
        })
    }

    /// A region and an offset in it with `bytes` free: the current
    /// region's next free bytes, a new shared region, or (for a matrix
    /// larger than one) a region of its own. `None` if nothing could be
    /// mapped.
    fn place(&mut self, bytes: usize) -> Option<(Arc<Region>, usize)> {
        if self.small {
            return None;
        }
        let bytes = bytes.max(1);
        if let Some((region, used)) = &mut self.current {
            let start = used.next_multiple_of(ALIGN);
            if start + bytes <= region.len {
                *used = start + bytes;
                return Some((Arc::clone(region), start));
            }
        }
        if bytes > REGION {
            let own = Arc::new(Region::new(bytes.next_multiple_of(HUGE_PAGE))?);
            return Some((own, 0));
        }
        let region = Arc::new(Region::new(REGION)?);
        self.current = Some((Arc::clone(&region), bytes));
        Some((region, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_values_come_back_in_aligned_huge_page_regions() {
        let mut pages = Pages::new();
        let small: Stored<u16> = pages.store(1000, (0..1000).map(|i| i as u16));
        let next: Stored<f32> = pages.store(3, [1.5f32, -2.0, 7.25]);
        let large: Stored<u32> = pages.store(REGION, (0..REGION as u32).map(|i| i ^ 0x5a5a));
        assert!(small.in_pages() && next.in_pages() && large.in_pages());
        assert!(small.iter().enumerate().all(|(i, &v)| v == i as u16));
        assert_eq!(&next[..], &[1.5, -2.0, 7.25]);
        assert!(
            large
                .iter()
                .enumerate()
                .all(|(i, &v)| v == i as u32 ^ 0x5a5a)
        );
        // Small matrices share a region; each slice starts on a cache line.
        assert_eq!(next.as_ptr() as usize - small.as_ptr() as usize, 2048);
        assert_eq!(small.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(large.as_ptr() as usize % HUGE_PAGE, 0);
        // The regions outlive the Pages that made them.
        drop(pages);
        assert_eq!(next[2], 7.25);
        let heap: Stored<u16> = Pages::on_small_pages().store(3, [4u16, 5, 6]);
        assert!(!heap.in_pages());
        assert_eq!(&heap[..], &[4, 5, 6]);
    }

    #[test]
    #[should_panic(expected = "5 values promised")]
    fn fewer_values_than_promised_are_refused() {
        Pages::new().store(5, [1u8, 2, 3]);
    }

    /// The `VmFlags` of the mapping holding `address` in
    /// `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    fn vm_flags(address: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((from, to)) = range.split_once('-')
                && let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                )
            {
                inside = (from..to).contains(&address);
            } else if inside && let Some(rest) = line.strip_prefix("VmFlags:") {
                return rest.split_whitespace().map(str::to_string).collect();
            }
        }
        panic!("no mapping holds {address:#x} in /proc/self/smaps");
    }

    /// The regions carry the `hg` flag (huge pages advised) in their
    /// mapping's VmFlags. Where the system does not show the flag even on a
    /// mapping advised here directly (qemu's user-mode emulation, which CI
    /// runs the aarch64 tests under, drops the advice), the test says so
    /// and checks nothing more.
    #[cfg(target_os = "linux")]
    #[test]
    fn regions_are_advised_huge_pages() {
        // SAFETY: a fresh private anonymous mapping, advised, read through
        // smaps and unmapped; nothing else refers to it.
        let shown = unsafe {
            let probe = libc::mmap(
                std::ptr::null_mut(),
                HUGE_PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(probe, libc::MAP_FAILED);
            let advised = libc::madvise(probe, HUGE_PAGE, libc::MADV_HUGEPAGE) == 0;
            let shown = advised && vm_flags(probe as usize).iter().any(|f| f == "hg");
            libc::munmap(probe, HUGE_PAGE);
            shown
        };
        if !shown {
            println!(
                "skipped: this system does not show MADV_HUGEPAGE in /proc/self/smaps (THP \
                 compiled out, or user-mode emulation)"
            );
            return;
        }
        let mut pages = Pages::new();
        let stored: Stored<u8> = pages.store(HUGE_PAGE, std::iter::repeat_n(1u8, HUGE_PAGE));
        let flags = vm_flags(stored.as_ptr() as usize);
        assert!(flags.iter().any(|f| f == "hg"), "VmFlags: {flags:?}");
    }
}
