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
