//! Every random byte the simulation's stack asks for comes from one stream seeded by
//! `--seed`, so a seed replays a run: getrandom's custom backend (libp2p, rand, ahash), and
//! libc's `getrandom`, which std looks up by name for `HashMap` keys (exported by
//! `sim/.cargo/config.toml`). Never in Ferry's own build.

use std::sync::atomic::{AtomicU64, Ordering};

static STATE: AtomicU64 = AtomicU64::new(0);
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Seeds the stream; call before anything draws.
pub fn seed(seed: u64) {
    STATE.store(seed.wrapping_mul(GOLDEN), Ordering::SeqCst);
}

/// SplitMix64.
fn next() -> u64 {
    let mut z = STATE
        .fetch_add(GOLDEN, Ordering::SeqCst)
        .wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The symbol getrandom 0.3 and 0.4 call with `getrandom_backend="custom"`.
///
/// # Safety
/// getrandom passes a writable buffer of `len` bytes.
#[unsafe(no_mangle)]
unsafe extern "Rust" fn __getrandom_v03_custom(
    dest: *mut u8,
    len: usize,
) -> Result<(), getrandom::Error> {
    // SAFETY: getrandom hands over `len` writable bytes at `dest`.
    let buf = unsafe { std::slice::from_raw_parts_mut(dest, len) };
    for chunk in buf.chunks_mut(8) {
        let bytes = next().to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    Ok(())
}

/// libc's `getrandom(2)`, as std finds it (a weak symbol it looks up, for interposition):
/// `RandomState`'s keys, and so every std `HashMap`'s iteration order, come from the seed.
///
/// # Safety
/// The caller passes a writable buffer of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getrandom(buf: *mut u8, len: usize, _flags: u32) -> isize {
    // SAFETY: as for the custom backend above.
    let _ = unsafe { __getrandom_v03_custom(buf, len) };
    isize::try_from(len).unwrap_or(isize::MAX)
}
