//! Chance in the routing stack (round jitter, walk targets, anchors, dial order), drawn from
//! one seed per node: the process's own in production, a fixed one in the simulation, so that
//! a seed replays a run. Invariant: the same seed and inputs give the same draws.

use std::hash::{BuildHasher, DefaultHasher, Hash, Hasher};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Draws {
    seed: u64,
}

impl Draws {
    /// `None`: drawn from the process's random state, as `HashMap`s are.
    pub(crate) fn new(seed: Option<u64>) -> Draws {
        Draws {
            seed: seed
                .unwrap_or_else(|| std::collections::hash_map::RandomState::new().hash_one(0u8)),
        }
    }

    /// Independent draws for one user (`tag`) of the same seed.
    pub(crate) fn derive(self, tag: &str) -> Draws {
        Draws {
            seed: self.hash_one(tag),
        }
    }

    /// A draw for `input`: uniform over `u64`, the same for the same seed and input.
    pub(crate) fn hash_one<T: Hash>(&self, input: T) -> u64 {
        // `DefaultHasher::new()` has fixed keys; the seed makes the draws this node's.
        let mut hasher = DefaultHasher::new();
        self.seed.hash(&mut hasher);
        input.hash(&mut hasher);
        hasher.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_draws_and_tags_differ() {
        let (a, b) = (Draws::new(Some(7)), Draws::new(Some(7)));
        assert_eq!(a.hash_one(3u64), b.hash_one(3u64));
        assert_ne!(a.derive("x").hash_one(3u64), a.derive("y").hash_one(3u64));
        assert_ne!(Draws::new(Some(8)).hash_one(3u64), a.hash_one(3u64));
    }
}
