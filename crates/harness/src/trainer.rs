//! The demo trainer behind `mx-lab publish`: a user of mx-publisher like any trainer. It loads this
//! rank's shards (per the trainer layout) from an HF checkpoint into memory it owns (one
//! huge-page [`HostBuffer`]), registers that memory with its publisher, and publishes versions
//! in place, applying [`mx_layout::update::training_step`] between them as an optimizer step
//! would. `--fault-flip-byte` flips one byte of a shard after each publish (a memory error or a
//! racing optimizer step), for the tests of verification.

use mx_checkpoint::Checkpoint;
use mx_layout::plan::decompose;
use mx_layout::{rank_layout, LayoutSpec, RankLayout, TensorBox};
use mx_nixl::{ForeignMemory, HostBuffer};
use mx_publisher::{Patience, PublishOptions, Publisher, PublisherConfig, ShardSpec};
use rayon::prelude::*;

/// What the demo trainer needs.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// Control plane address.
    pub control: String,
    /// HF checkpoint directory (config.json + safetensors).
    pub model_dir: std::path::PathBuf,
    /// Trainer layout.
    pub layout: LayoutSpec,
    /// This trainer rank.
    pub rank: u32,
    /// Source-side packing.
    pub pack: bool,
    /// Fault injection: after each publish, flip one byte of this tensor's shard.
    pub fault_flip_byte: Option<String>,
}

/// One trainer rank: its publisher and the memory its shards live in.
pub struct DemoTrainer {
    // Field order is drop order: the publisher (and its registration of `buf`) goes first.
    publisher: Publisher,
    buf: HostBuffer,
    rank_layout: RankLayout,
    fault_flip_byte: Option<String>,
}

/// Copies `region` of a full row-major tensor `full` (shape `shape`) into `out`, row-major.
fn copy_box(full: &[u8], shape: &[u64], region: &TensorBox, elem: u64, out: &mut [u8]) {
    let (run, starts) = decompose(region, &TensorBox::full(shape));
    let rb = (run * elem) as usize;
    for (i, s) in starts.iter().enumerate() {
        let s = (*s * elem) as usize;
        out[i * rb..(i + 1) * rb].copy_from_slice(&full[s..s + rb]);
    }
}

impl DemoTrainer {
    /// Loads this rank's shards and connects its publisher.
    pub async fn start(cfg: TrainerConfig) -> anyhow::Result<DemoTrainer> {
        let ckpt = Checkpoint::open(&cfg.model_dir)?;
        let model = ckpt.model_info(&[cfg.layout])?;
        anyhow::ensure!(
            cfg.rank < cfg.layout.world_size,
            "rank {} is outside layout {}",
            cfg.rank,
            cfg.layout
        );
        let rl = rank_layout(&model, cfg.layout, cfg.rank)?;
        let mut buf = HostBuffer::new(rl.total_bytes.max(1))?;
        {
            let out = buf.as_mut_slice();
            for piece in rl.params.iter().flat_map(|p| &p.pieces) {
                let t = ckpt.tensor(&piece.tensor)?;
                let elem = piece.dtype.size_bytes();
                let len = (piece.region.numel().unwrap_or(0) * elem) as usize;
                let o = piece.offset as usize;
                copy_box(t.data, &t.shape, &piece.region, elem, &mut out[o..o + len]);
            }
        }
        let mut publisher = Publisher::connect(PublisherConfig {
            control: cfg.control,
            slot: cfg.rank,
            layout: cfg.layout,
            model,
            pack: cfg.pack,
        })
        .await?;
        // SAFETY: `buf` is a live mapping of `buf.len()` initialized bytes that stays mapped
        // until after the registration is dropped (the publisher, which owns it, is dropped
        // first: field order). It is written only by `train_step`, which `run_steps_from`
        // calls only after `wait_committed` handed the previous version back, and by the
        // fault injection, whose whole point is a write the verification must catch.
        let mem =
            unsafe { ForeignMemory::register_host(publisher.agent(), buf.addr(), buf.len()) }?;
        let id = publisher.register(mem)?;
        let specs = rl
            .params
            .iter()
            .flat_map(|p| &p.pieces)
            .map(|piece| ShardSpec {
                tensor: piece.tensor.clone(),
                dtype: piece.dtype,
                global_shape: piece.global_shape.clone(),
                shard: piece.region.clone(),
                memory: id,
                offset: piece.offset,
            })
            .collect();
        publisher.set_shards(specs)?;
        Ok(DemoTrainer {
            publisher,
            buf,
            rank_layout: rl,
            fault_flip_byte: cfg.fault_flip_byte,
        })
    }

    /// Applies `training_step(step)` to every shard in place.
    pub fn train_step(&mut self, step: u32) {
        let mut rest: &mut [u8] = self.buf.as_mut_slice();
        let mut chunks = Vec::new();
        let mut pos = 0u64;
        for p in &self.rank_layout.params {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((p.offset - pos) as usize);
            let (mine, tail) = tail.split_at_mut(p.len as usize);
            chunks.push((p.dtype, mine));
            rest = tail;
            pos = p.offset + p.len;
        }
        chunks
            .into_par_iter()
            .for_each(|(dt, b)| mx_layout::update::training_step(dt, b, step));
    }

    /// Fault injection: flips the middle byte of this rank's shard of `tensor` in the
    /// registered memory, after its digests were published. Returns the flipped address, or
    /// `None` when this rank holds none of `tensor`.
    pub fn flip_byte(&mut self, tensor: &str) -> Option<u64> {
        let piece = self
            .rank_layout
            .params
            .iter()
            .flat_map(|p| p.pieces.iter())
            .find(|p| p.tensor == tensor)?;
        let len = piece.region.numel()? * piece.dtype.size_bytes();
        if len == 0 {
            return None;
        }
        let at = piece.offset + len / 2;
        let addr = self.buf.addr() + at;
        *self.buf.as_mut_slice().get_mut(at as usize)? ^= 0x01;
        tracing::warn!(tensor, addr, "fault injected: flipped one byte");
        Some(addr)
    }

    /// Publishes versions `{prefix}{k}` for k in `first..=steps` (training steps 2..=`first`
    /// are applied first, without publishing: a trainer that joins later). Before version
    /// k > `first` it waits until k-1 is COMMITTED (which hands the memory back), then applies
    /// training step k. Returns once the last version is COMMITTED. Every wait follows
    /// `patience`.
    pub async fn run_steps_from(
        &mut self,
        prefix: &str,
        first: u32,
        steps: u32,
        patience: Patience,
    ) -> Result<(), mx_publisher::Error> {
        let first = first.max(1);
        for k in 2..=first.min(steps) {
            self.train_step(k);
        }
        let opts = PublishOptions {
            copy: false,
            patience,
        };
        for k in first..=steps {
            if k > first {
                let prev = format!("{prefix}{}", k - 1);
                self.publisher.wait_committed(&prev, patience).await?;
                self.train_step(k);
            }
            self.publisher
                .publish(&format!("{prefix}{k}"), opts)
                .await?;
            if let Some(t) = self.fault_flip_byte.clone() {
                self.flip_byte(&t);
            }
        }
        if first > steps {
            return Ok(());
        }
        self.publisher
            .wait_committed(&format!("{prefix}{steps}"), patience)
            .await
    }
}
