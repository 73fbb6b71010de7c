//! The process's allocator thresholds.
//!
//! glibc serves allocations of 128 KiB and more with `mmap` by default, and trims freed memory
//! off the top of the heap as soon as 128 KiB of it is free. gradsync allocates such buffers
//! again and again: the `gemm` crate allocates its packing buffers (megabytes for mnist's
//! layers) inside every call, and h2 reads every HTTP/2 DATA frame (1 MiB and more) into a
//! fresh buffer. Each such allocation then lands in pages the kernel must fault in and zero:
//! measured, a tenth of the CPU time of the forward GEMMs (`clear_page_erms` under the gemm
//! crate's packing) and a fifth of a 64 MB parameter-server step's (`docs/ps.md`). With
//! [`keep_freed_memory`] freed buffers are recycled from the heap instead.
//!
//! Large buffers (parameters, gradients, momentum, all-reduce buffers) come from [`zeros`],
//! which asks for transparent huge pages: the kernel's socket copies and the sums walk them
//! with a 512th of the TLB misses.

/// Keep freed memory in the process rather than handing it back to the kernel at once.
///
/// Process-wide and idempotent; called by the CPU device, the server, the PS worker and the
/// benchmarks. A no-op outside glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; any value is valid for these two.
    unsafe {
        // 32 MiB: glibc's largest mmap threshold; packing buffers, frames and chunks stay below.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// One malloc arena for the whole process, for the parameter-server processes (server, PS
/// worker, PS benchmark), which allocate megabyte chunk buffers on one runtime thread and free
/// them on another. A thread's own arena lives in 64 MiB heaps that glibc unmaps as soon as
/// they empty, whatever the trim threshold, so those buffers kept landing in freshly mapped
/// pages: about 7 k page faults per 64 MB step, with the TLB shootdowns of the unmaps; none
/// with one arena (`docs/ps.md`). Call it before the process starts its threads (a thread that
/// already has an arena keeps it). A no-op outside glibc.
pub fn single_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes an allocator setting; 1 is a valid arena count.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// The transparent huge page size on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// `n` zeros in memory that the kernel is asked to back with transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`, before any page is touched) wherever the buffer spans whole
/// 2 MiB pages; smaller buffers get plain `vec![T::default(); n]` memory.
///
/// Where the machine's THP setting is `madvise` (the usual default), nothing else gets huge
/// pages: a 64 MB all-reduce walks 16,384 pages of 4 KiB through the kernel's copies and the
/// sums, and measured on 2 cores, 4 and 8 ranks moved 1.4% and 2.8% more with them (median of
/// six interleaved rounds each, `docs/benchmarks.md`). With THP `never`, or outside Linux, the
/// advice is not given or ignored and the buffer is the same zeros.
pub fn zeros<T: Copy + Default>(n: usize) -> Vec<T> {
    filled(n, T::default())
}

/// `n` copies of `value`, in memory allocated as [`zeros`]'s is.
pub fn filled<T: Copy>(n: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    advise_huge_pages(v.spare_capacity_mut());
    v.resize(n, value);
    v
}

/// Ask for huge pages over the whole 2 MiB pages inside `buf` (not yet touched). Advice only:
/// a kernel that refuses it leaves the memory as it was.
fn advise_huge_pages<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        let (at, len) = (buf.as_mut_ptr() as usize, std::mem::size_of_val(buf));
        let start = at.next_multiple_of(HUGE_PAGE);
        let end = (at + len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: [start, end) lies inside `buf`'s allocation and is page-aligned;
            // MADV_HUGEPAGE changes how the kernel backs the range, never its contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` of the mapping in `/proc/self/smaps` that holds address `at`.
    #[cfg(target_os = "linux")]
    fn vm_flags(at: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("reading /proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&at);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping holds {at:#x}");
    }

    #[test]
    fn zeros_are_zeros_of_any_size() {
        for n in [0, 1, 1000, (HUGE_PAGE / 4) * 3 + 5] {
            let v: Vec<f32> = zeros(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
        }
        let v: Vec<u8> = zeros(5);
        assert_eq!(v, [0; 5]);
        assert_eq!(filled(3, 7u8), [7; 3]);
    }

    /// The whole huge pages inside a large buffer carry the advice (`hg` in the mapping's
    /// flags); a buffer too small to span one does not ask.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_ask_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("SKIPPED: this kernel has no transparent huge pages, so nothing can ask for them");
            return;
        }
        let big: Vec<f32> = zeros(4 * HUGE_PAGE / 4);
        let inner = (big.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let flags = vm_flags(inner);
        assert!(flags.split(' ').any(|f| f == "hg"), "no MADV_HUGEPAGE on the buffer: VmFlags {flags}");

        let small: Vec<f32> = zeros(1000);
        let flags = vm_flags(small.as_ptr() as usize);
        assert!(!flags.split(' ').any(|f| f == "hg"), "a 4 KB buffer was advised: VmFlags {flags}");
    }
}
