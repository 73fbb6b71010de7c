//! The reduction math the host collectives share (the ring, the chains, shared memory, and
//! DataParallel's master): element-wise sums, written once.

/// `dst += src`, element-wise; a plain loop the compiler vectorises.
pub(crate) fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}
