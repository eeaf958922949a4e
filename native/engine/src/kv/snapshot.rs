//! Copies of a sequence's cached keys and values that live outside the KV budget: the
//! Server's level-2 prompt cache keeps evicted prefixes in host RAM as [`KvSnapshot`]s and
//! restores them on a prefix hit instead of evaluating the prompt again, and
//! `Server.save_prefix/3` writes one to disk ([`KvSnapshot::to_bytes`]).
//!
//! A snapshot holds whole blocks in the cache's own storage types (no conversion, so a
//! restore gives back exactly what was cached; under a `kv_policy` the blocks of one sequence
//! may have different precisions, and each keeps its own) and the layout they came from; a
//! restore into a cache of another layout (another model, other KV types) is an error.

use super::{split_id, KvCache, KvType, KvTypes, KV_BLOCK_SIZE, MAX_KV_TIERS, NO_BLOCK};
use crate::error::{EngineError, Result};

/// What a snapshot's blocks mean: a cache must have the same layout to take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    n_kv_heads: usize,
    head_dim: usize,
    /// The precisions a block may have (a cache's tiers).
    tiers: Vec<KvTypes>,
    /// The layer group of every layer.
    layer_group: Vec<usize>,
    /// The sliding window of every group (None: full attention).
    windows: Vec<Option<usize>>,
}

impl KvLayout {
    /// Words of one layer's keys and of its values in one block of `tier`.
    fn words(&self, tier: usize) -> (usize, usize) {
        let elems = KV_BLOCK_SIZE * self.n_kv_heads * self.head_dim;
        let (k, v) = self.tiers[tier];
        (k.bytes(elems) / 4, v.bytes(elems) / 4)
    }
}

/// The first `len` positions of one sequence: per layer group the tier of each logical block
/// (`None` where a sliding window dropped it), per layer the keys and values of those blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSnapshot {
    layout: KvLayout,
    len: usize,
    present: Vec<Vec<Option<u8>>>,
    /// Per layer: the key words of its group's present blocks, then their value words.
    data: Vec<Vec<u32>>,
}

const MAGIC: &[u8; 8] = b"LCXKV\0\0\x02";

impl KvSnapshot {
    /// An error unless the snapshot can be restored into a cache of `layout`.
    pub fn check_layout(&self, layout: &KvLayout) -> Result<()> {
        if &self.layout == layout {
            Ok(())
        } else {
            Err(EngineError::InvalidArgument(
                "the KV snapshot was taken from another model or other KV cache types".into(),
            ))
        }
    }

    /// Positions it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of cached keys and values it holds (what the level-2 budget counts).
    pub fn bytes(&self) -> usize {
        self.data.iter().map(|d| d.len() * 4).sum()
    }

    /// A self-describing byte form (little-endian), for files.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes() + 256);
        out.extend_from_slice(MAGIC);
        let l = &self.layout;
        let mut put = |x: usize| out.extend_from_slice(&(x as u64).to_le_bytes());
        put(l.n_kv_heads);
        put(l.head_dim);
        put(l.tiers.len());
        for &(k, v) in &l.tiers {
            put(type_code(k));
            put(type_code(v));
        }
        put(self.len);
        put(l.windows.len());
        for w in &l.windows {
            put(w.map_or(0, |w| w + 1));
        }
        put(l.layer_group.len());
        for &g in &l.layer_group {
            put(g);
        }
        for p in &self.present {
            put(p.len());
            for &b in p {
                put(b.map_or(0, |t| t as usize + 1));
            }
        }
        for d in &self.data {
            put(d.len());
        }
        for d in &self.data {
            for w in d {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        out
    }

    /// Reads [`KvSnapshot::to_bytes`]'s form; anything malformed or inconsistent is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |why: &str| EngineError::InvalidArgument(format!("not a KV snapshot: {why}"));
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(bad("wrong header"));
        }
        let mut at = MAGIC.len();
        let mut get = || -> Result<usize> {
            let b = bytes.get(at..at + 8).ok_or_else(|| bad("truncated"))?;
            at += 8;
            usize::try_from(u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .map_err(|_| bad("a field is out of range"))
        };
        // every count below bounds an allocation: none may exceed what the input could hold
        let limit = bytes.len();
        let count = |get: &mut dyn FnMut() -> Result<usize>| -> Result<usize> {
            let n = get()?;
            if n > limit {
                return Err(bad("a count exceeds the input"));
            }
            Ok(n)
        };
        let n_kv_heads = get()?;
        let head_dim = get()?;
        let n_tiers = get()?;
        if n_tiers == 0 || n_tiers > MAX_KV_TIERS {
            return Err(bad("wrong number of precisions"));
        }
        let mut tiers = Vec::with_capacity(n_tiers);
        for _ in 0..n_tiers {
            let k = type_of(get()?).ok_or_else(|| bad("unknown key type"))?;
            let v = type_of(get()?).ok_or_else(|| bad("unknown value type"))?;
            tiers.push((k, v));
        }
        let len = get()?;
        let n_groups = count(&mut get)?;
        let mut windows = Vec::with_capacity(n_groups);
        for _ in 0..n_groups {
            windows.push(get()?.checked_sub(1));
        }
        let n_layers = count(&mut get)?;
        let mut layer_group = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            let g = get()?;
            if g >= n_groups {
                return Err(bad("a layer names a group that does not exist"));
            }
            layer_group.push(g);
        }
        let mut present = Vec::with_capacity(n_groups);
        for _ in 0..n_groups {
            let n = count(&mut get)?;
            let mut p = Vec::with_capacity(n);
            for _ in 0..n {
                p.push(match get()? {
                    0 => None,
                    t if t <= n_tiers => Some((t - 1) as u8),
                    _ => return Err(bad("a block names a precision that does not exist")),
                });
            }
            present.push(p);
        }
        let mut sizes = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            sizes.push(count(&mut get)?);
        }
        let layout = KvLayout {
            n_kv_heads,
            head_dim,
            tiers,
            layer_group,
            windows,
        };
        let mut data = Vec::with_capacity(n_layers);
        let mut rest = bytes.get(at..).ok_or_else(|| bad("truncated"))?;
        for &n in &sizes {
            let chunk = rest.get(..n * 4).ok_or_else(|| bad("truncated"))?;
            data.push(
                chunk
                    .chunks_exact(4)
                    .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
                    .collect(),
            );
            rest = &rest[n * 4..];
        }
        if !rest.is_empty() {
            return Err(bad("trailing bytes"));
        }
        let snap = KvSnapshot {
            layout,
            len,
            present,
            data,
        };
        snap.check()?;
        Ok(snap)
    }

    /// The sizes agree with the layout: every group has an entry per block of `len`, every
    /// layer the words of its group's present blocks.
    fn check(&self) -> Result<()> {
        let l = &self.layout;
        let n_blocks = self.len.div_ceil(KV_BLOCK_SIZE);
        let bad = |why: &str| EngineError::InvalidArgument(format!("not a KV snapshot: {why}"));
        if self.present.len() != l.windows.len() || self.data.len() != l.layer_group.len() {
            return Err(bad("groups or layers do not match the layout"));
        }
        if self.present.iter().any(|p| p.len() != n_blocks) {
            return Err(bad("block flags do not match its length"));
        }
        KV_BLOCK_SIZE
            .checked_mul(l.n_kv_heads)
            .and_then(|x| x.checked_mul(l.head_dim))
            .filter(|&e| e <= 1 << 32)
            .ok_or_else(|| bad("absurd head sizes"))?;
        for (layer, d) in self.data.iter().enumerate() {
            let mut words = 0usize;
            for t in self.present[l.layer_group[layer]].iter().flatten() {
                let (wk, wv) = l.words(*t as usize);
                words = words
                    .checked_add(wk + wv)
                    .ok_or_else(|| bad("absurd sizes"))?;
            }
            if d.len() != words {
                return Err(bad("layer data does not match its blocks"));
            }
        }
        Ok(())
    }
}

fn type_code(t: KvType) -> usize {
    match t {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Q8_0 => 8,
        KvType::Q4_0 => 2,
    }
}

fn type_of(code: usize) -> Option<KvType> {
    Some(match code {
        0 => KvType::F32,
        1 => KvType::F16,
        8 => KvType::Q8_0,
        2 => KvType::Q4_0,
        _ => return None,
    })
}

impl KvCache {
    /// The layout a snapshot must have to be restored here.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            tiers: self.tiers(),
            layer_group: self.layer_group.clone(),
            windows: self.groups.iter().map(|g| g.window).collect(),
        }
    }

    /// The blocks of `seq` that hold its first `n_blocks` logical blocks, per layer group.
    fn held_blocks(&self, seq: usize, n_blocks: usize) -> Vec<Vec<u32>> {
        self.groups
            .iter()
            .map(|g| {
                let table = &g.seqs[seq].blocks;
                table[..n_blocks.min(table.len())].to_vec()
            })
            .collect()
    }

    /// Bytes a snapshot of the first `len` positions of `seq` would take (its blocks, keys and
    /// values of every layer), so a caller can refuse it before anything is copied.
    pub fn snapshot_bytes(&self, seq: usize, len: usize) -> usize {
        let n_blocks = len.min(self.lens[seq]).div_ceil(KV_BLOCK_SIZE);
        let held = self.held_blocks(seq, n_blocks);
        self.layer_group
            .iter()
            .map(|&g| {
                held[g]
                    .iter()
                    .filter(|&&b| b != NO_BLOCK)
                    .map(|&b| {
                        let t = &self.groups[g].tiers[split_id(b).0];
                        (t.k_words + t.v_words) * 4
                    })
                    .sum::<usize>()
            })
            .sum()
    }

    /// Copies the first `len` positions of `seq` (at most what it holds). Errors when a
    /// sliding window already dropped what position `len` attends to.
    fn refuse_on_device(&self) -> Result<()> {
        if self.on_device() {
            return Err(EngineError::Unsupported(
                "KV snapshots of a cache in GPU memory (prompt caches in host RAM or on disk)"
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn snapshot(&self, seq: usize, len: usize) -> Result<KvSnapshot> {
        self.refuse_on_device()?;
        let len = len.min(self.lens[seq]);
        if !self.prefix_usable(seq, len) {
            return Err(EngineError::InvalidArgument(format!(
                "sequence {seq} no longer holds the window needed to continue after {len} positions"
            )));
        }
        let n_blocks = len.div_ceil(KV_BLOCK_SIZE);
        let held = self.held_blocks(seq, n_blocks);
        let present: Vec<Vec<Option<u8>>> = held
            .iter()
            .map(|blocks| {
                (0..n_blocks)
                    .map(|bi| {
                        blocks
                            .get(bi)
                            .filter(|&&b| b != NO_BLOCK)
                            .map(|&b| split_id(b).0 as u8)
                    })
                    .collect()
            })
            .collect();
        let data = (0..self.n_layers())
            .map(|layer| {
                let blocks: Vec<u32> = held[self.layer_group[layer]]
                    .iter()
                    .copied()
                    .filter(|&b| b != NO_BLOCK)
                    .collect();
                let mut d = Vec::new();
                for values in [false, true] {
                    for &b in &blocks {
                        let (t, k_at, v_at) = self.locate(layer, b);
                        let (at, n) = if values {
                            (v_at, t.v_words)
                        } else {
                            (k_at, t.k_words)
                        };
                        d.extend_from_slice(&t.store.words()[at..at + n]);
                    }
                }
                d
            })
            .collect();
        Ok(KvSnapshot {
            layout: self.layout(),
            len,
            present,
            data,
        })
    }

    /// Makes `seq` hold exactly the snapshot's positions, in newly allocated blocks of the
    /// precisions they were saved in. Errors (with `seq` left empty) when the layout differs or
    /// the free budget cannot hold it.
    pub fn restore(&mut self, seq: usize, snap: &KvSnapshot) -> Result<()> {
        self.refuse_on_device()?;
        snap.check_layout(&self.layout())?;
        self.seq_clear(seq);
        for (g, present) in snap.present.iter().enumerate() {
            for &held in present {
                let b = match held {
                    None => NO_BLOCK,
                    Some(tier) => match self.groups[g].alloc(tier as usize) {
                        Some(b) => b,
                        None => {
                            self.seq_clear(seq);
                            return Err(EngineError::ContextFull { seq });
                        }
                    },
                };
                self.groups[g].seqs[seq].blocks.push(b);
            }
        }
        for (layer, d) in snap.data.iter().enumerate() {
            let (g, li) = (self.layer_group[layer], self.layer_slot[layer]);
            let blocks: Vec<u32> = self.groups[g].seqs[seq]
                .blocks
                .iter()
                .copied()
                .filter(|&b| b != NO_BLOCK)
                .collect();
            let mut from = 0;
            for values in [false, true] {
                for &b in &blocks {
                    let (tier, idx) = split_id(b);
                    let t = &mut self.groups[g].tiers[tier];
                    let (k_at, v_at) = t.layer_at(idx, li);
                    let (at, n) = if values {
                        (v_at, t.v_words)
                    } else {
                        (k_at, t.k_words)
                    };
                    t.store.words_mut()[at..at + n].copy_from_slice(&d[from..from + n]);
                    from += n;
                }
            }
        }
        self.lens[seq] = snap.len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(windows: &[Option<usize>], t: KvType) -> KvCache {
        KvCache::new(windows, 2, 32, 512, (3, 0), (t, t)).unwrap()
    }

    fn fill(kv: &mut KvCache, seq: usize, to: usize, tag: f32) {
        kv.reserve(seq, 0, to).unwrap();
        for p in 0..to {
            let row: Vec<f32> = (0..64)
                .map(|i| tag + p as f32 * 0.5 + i as f32 * 0.01)
                .collect();
            for l in 0..kv.n_layers() {
                kv.write(l, seq, p, &row, &row);
            }
        }
        kv.commit(seq, to);
    }

    fn rows(kv: &KvCache, seq: usize, len: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for l in 0..kv.n_layers() {
            for values in [false, true] {
                for (bi, &b) in kv.seq_view(l, seq).blocks.iter().enumerate() {
                    if b == NO_BLOCK || bi * KV_BLOCK_SIZE >= len {
                        continue;
                    }
                    let n = (len - bi * KV_BLOCK_SIZE).min(KV_BLOCK_SIZE);
                    let mut buf = vec![0f32; n * 64];
                    kv.read_block(l, values, b, n, &mut buf);
                    out.extend(buf);
                }
            }
        }
        out
    }

    #[test]
    fn a_restored_sequence_reads_what_was_saved_in_every_type() {
        for t in [KvType::F32, KvType::F16, KvType::Q8_0, KvType::Q4_0] {
            let mut kv = cache(&[None, None], t);
            fill(&mut kv, 0, 45, 1.0);
            let snap = kv.snapshot(0, 40).unwrap();
            assert_eq!(snap.len(), 40);
            assert_eq!(snap.bytes(), kv.snapshot_bytes(0, 40));
            let back = KvSnapshot::from_bytes(&snap.to_bytes()).unwrap();
            assert_eq!(back, snap);
            kv.seq_clear(0);
            fill(&mut kv, 1, 30, 7.0);
            kv.restore(2, &back).unwrap();
            assert_eq!(kv.seq_len(2), 40);
            fill(&mut kv, 0, 45, 1.0);
            assert_eq!(rows(&kv, 2, 40), rows(&kv, 0, 40), "{t:?}");
            kv.audit().unwrap();
        }
    }

    #[test]
    fn sliding_window_blocks_stay_dropped_and_restore_continues() {
        let mut kv = cache(&[Some(32), None], KvType::F16);
        fill(&mut kv, 0, 100, 0.0);
        let snap = kv.snapshot(0, 100).unwrap();
        assert_eq!(snap.present[0].iter().flatten().count(), 3);
        assert_eq!(snap.present[1].iter().flatten().count(), 7);
        assert!(
            kv.snapshot(0, 40).is_err(),
            "the window dropped what 40 needs"
        );
        kv.restore(1, &snap).unwrap();
        assert_eq!(rows(&kv, 1, 100), rows(&kv, 0, 100));
        assert_eq!(kv.usage().used, vec![6, 14]);
        kv.audit().unwrap();
    }

    #[test]
    fn a_restore_that_does_not_fit_or_does_not_match_leaves_nothing() {
        let mut kv = KvCache::new(&[None], 2, 32, 64, (2, 0), (KvType::F16, KvType::F16)).unwrap();
        fill(&mut kv, 0, 64, 0.0);
        let snap = kv.snapshot(0, 64).unwrap();
        fill(&mut kv, 1, 20, 0.0);
        let err = kv.restore(1, &snap).unwrap_err();
        assert!(matches!(err, EngineError::ContextFull { seq: 1 }), "{err}");
        assert_eq!(kv.seq_len(1), 0);
        kv.audit().unwrap();

        let mut other = cache(&[None, None], KvType::F16);
        assert!(other.restore(0, &snap).is_err(), "another layout");
        let mut q8 = KvCache::new(&[None], 2, 32, 64, (2, 0), (KvType::Q8_0, KvType::F16)).unwrap();
        assert!(q8.restore(0, &snap).is_err(), "other KV types");
    }

    #[test]
    fn blocks_of_several_precisions_are_restored_in_theirs() {
        let tiers = [(KvType::F16, KvType::F16), (KvType::Q4_0, KvType::Q4_0)];
        let mut kv = KvCache::with_tiers(&[Some(32), None], 2, 32, 512, (3, 0), &tiers).unwrap();
        fill(&mut kv, 0, 40, 1.0);
        kv.set_write_tier(1).unwrap();
        kv.reserve(0, 40, 70).unwrap();
        for p in 40..70 {
            let row: Vec<f32> = (0..64).map(|i| p as f32 * 0.5 + i as f32 * 0.01).collect();
            for l in 0..kv.n_layers() {
                kv.write(l, 0, p, &row, &row);
            }
        }
        kv.commit(0, 70);
        let snap = kv.snapshot(0, 70).unwrap();
        assert_eq!(snap.bytes(), kv.snapshot_bytes(0, 70));
        let back = KvSnapshot::from_bytes(&snap.to_bytes()).unwrap();
        assert_eq!(back, snap);
        kv.set_write_tier(0).unwrap();
        kv.restore(1, &back).unwrap();
        assert_eq!(rows(&kv, 1, 70), rows(&kv, 0, 70));
        // the window group holds blocks 2 (f16), 3 and 4 (q4_0); the full group 0..=2 and 3, 4
        assert_eq!(kv.blocks_by_tier(), [2 * (1 + 3), 2 * (2 + 2)]);
        kv.audit().unwrap();
    }

    #[test]
    fn malformed_bytes_are_errors_not_panics() {
        let mut kv = cache(&[Some(32), None], KvType::Q8_0);
        fill(&mut kv, 0, 50, 0.0);
        let bytes = kv.snapshot(0, 50).unwrap().to_bytes();
        assert!(KvSnapshot::from_bytes(&bytes).is_ok());
        for cut in [0, 7, 8, 20, 100, bytes.len() - 1] {
            assert!(
                KvSnapshot::from_bytes(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(KvSnapshot::from_bytes(&longer).is_err());
        // a huge count is refused before anything is allocated
        let mut huge = bytes.clone();
        huge[8 + 6 * 8..8 + 7 * 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(KvSnapshot::from_bytes(&huge).is_err());
        // every single-byte corruption of the header is an error or a consistent snapshot
        for i in 8..200.min(bytes.len()) {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            if let Ok(s) = KvSnapshot::from_bytes(&b) {
                s.check().unwrap();
            }
        }
    }
}
