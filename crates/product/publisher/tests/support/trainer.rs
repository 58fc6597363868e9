//! A test trainer rank: this rank's shards of a checkpoint in a buffer the test owns, registered
//! with a real publisher (shared by mx-publisher's and mx-worker's integration tests).
#![allow(dead_code, reason = "each test binary uses a subset")]

use std::path::Path;

use mx_checkpoint::Checkpoint;
use mx_layout::plan::decompose;
use mx_layout::{rank_layout, LayoutSpec, ModelInfo, RankLayout, TensorBox};
use mx_nixl::{ForeignMemory, HostBuffer};
use mx_publisher::{
    MemoryId, Patience, PublishOptions, Published, Publisher, PublisherConfig, ShardSpec,
};

/// One trainer rank. Field order is drop order: the publisher (holding the registration)
/// before the buffer.
pub(crate) struct TestTrainer {
    pub(crate) publisher: Publisher,
    pub(crate) buf: HostBuffer,
    pub(crate) rl: RankLayout,
    pub(crate) memory: MemoryId,
}

pub(crate) fn model(dir: &Path) -> ModelInfo {
    let ckpt = Checkpoint::open(dir).unwrap();
    ModelInfo::from_hf_config(ckpt.config().unwrap(), ckpt.specs()).unwrap()
}

/// Loads `rank` of `layout` from the checkpoint at `dir`, registers it and sets its shards.
pub(crate) async fn start(control: &str, dir: &Path, layout: LayoutSpec, rank: u32) -> TestTrainer {
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = model(dir);
    let rl = rank_layout(&model, layout, rank).unwrap();
    let mut buf = HostBuffer::new(rl.total_bytes).unwrap();
    for piece in rl.params.iter().flat_map(|p| &p.pieces) {
        let t = ckpt.tensor(&piece.tensor).unwrap();
        let elem = piece.dtype.size_bytes();
        let (run, starts) = decompose(&piece.region, &TensorBox::full(&t.shape));
        let rb = (run * elem) as usize;
        let out = &mut buf.as_mut_slice()[piece.offset as usize..];
        for (i, s) in starts.iter().enumerate() {
            let s = (*s * elem) as usize;
            out[i * rb..(i + 1) * rb].copy_from_slice(&t.data[s..s + rb]);
        }
    }
    let mut publisher = Publisher::connect(PublisherConfig {
        control: control.to_string(),
        slot: rank,
        layout,
        model,
        pack: true,
    })
    .await
    .unwrap();
    // SAFETY: `buf` outlives the registration (TestTrainer drops the publisher first) and the
    // tests write it only after a version was handed back, or in copy mode.
    let mem =
        unsafe { ForeignMemory::register_host(publisher.agent(), buf.addr(), buf.len()) }.unwrap();
    let memory = publisher.register(mem).unwrap();
    publisher.set_shards(specs(&rl, memory)).unwrap();
    TestTrainer {
        publisher,
        buf,
        rl,
        memory,
    }
}

/// The shard specs of a rank layout whose bytes sit at their offsets in `memory`.
pub(crate) fn specs(rl: &RankLayout, memory: MemoryId) -> Vec<ShardSpec> {
    rl.params
        .iter()
        .flat_map(|p| &p.pieces)
        .map(|piece| ShardSpec {
            tensor: piece.tensor.clone(),
            dtype: piece.dtype,
            global_shape: piece.global_shape.clone(),
            shard: piece.region.clone(),
            memory,
            offset: piece.offset,
        })
        .collect()
}

impl TestTrainer {
    /// Applies `training_step(step)` to every shard in place.
    pub(crate) fn train_step(&mut self, step: u32) {
        for p in &self.rl.params {
            let b = &mut self.buf.as_mut_slice()[p.offset as usize..(p.offset + p.len) as usize];
            mx_layout::update::training_step(p.dtype, b, step);
        }
    }
}

/// Publishes `label` from every trainer at once (a publish returns once the version is READY,
/// which needs every slot).
pub(crate) async fn publish_all(
    pubs: &mut [TestTrainer],
    label: &str,
    copy: bool,
) -> Vec<Published> {
    let opts = PublishOptions {
        copy,
        patience: Patience::GiveUpAfter(std::time::Duration::from_secs(120)),
    };
    futures_util::future::try_join_all(pubs.iter_mut().map(|t| t.publisher.publish(label, opts)))
        .await
        .unwrap()
}
