//! Memory the caller owns, registered with [`ForeignMemory`] and read by a second real agent
//! over NIXL (UCX, in one process); a second registration reaches a peer that loads the owner's
//! metadata again under the same name. Passes with a message when NIXL is missing
//! (`MX_REQUIRE_NIXL=1` makes that a failure).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: panics are failures"
)]

use std::time::Duration;

use mx_nixl::{
    nixl_or_skip, Agent, Arena, Error, ForeignMemory, HostBuffer, MemoryKind, ReadOp, ReadOptions,
};

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

#[test]
fn caller_owned_memory_is_read_by_a_peer_and_later_registrations_reach_it() {
    if !nixl_or_skip("caller_owned_memory_is_read_by_a_peer") {
        return;
    }
    let pid = std::process::id();
    let owner = Agent::new(&format!("mx-foreign-owner-{pid}")).unwrap();
    let _progress = owner.spawn_progress(Duration::from_millis(1));
    let reader = Agent::new(&format!("mx-foreign-reader-{pid}")).unwrap();

    // A Vec the caller owns.
    let mut first = vec![0u8; 3 << 20];
    fill(&mut first, 1);
    // SAFETY: `first` lives until the end of the test, after `mem1` is dropped, and is not
    // written while registered.
    let mem1 =
        unsafe { ForeignMemory::register_host(&owner, first.as_ptr() as u64, first.len() as u64) }
            .unwrap();
    assert_eq!(mem1.kind(), MemoryKind::Host);
    assert_eq!(mem1.as_slice().unwrap(), &first[..]);
    let mut back = vec![0u8; 100];
    mem1.read_into(1000, &mut back).unwrap();
    assert_eq!(back, first[1000..1100]);
    assert!(matches!(
        mem1.read_into(first.len() as u64 - 10, &mut back),
        Err(Error::BadLength { .. })
    ));

    let remote = reader
        .load_remote(&owner.local_metadata().unwrap())
        .unwrap();
    let mut dst = Arena::new(&reader, 8 << 20).unwrap();
    let ops = [
        ReadOp {
            remote_addr: mem1.addr(),
            len: mem1.len(),
            local_offset: 0,
        },
        ReadOp {
            remote_addr: mem1.addr() + 12_345,
            len: 777,
            local_offset: 4 << 20,
        },
    ];
    reader
        .read(&remote, &ops, &mut dst, &ReadOptions::default())
        .unwrap();
    assert_eq!(&dst.as_slice()[..first.len()], &first[..]);
    assert_eq!(
        &dst.as_slice()[4 << 20..(4 << 20) + 777],
        &first[12_345..12_345 + 777]
    );

    // A second region registered later (a new snapshot or packing arena of a publisher): the
    // peer loads the owner's metadata again, under the same name, and reads it.
    let mut second = HostBuffer::new(1 << 20).unwrap();
    fill(second.as_mut_slice(), 9);
    // SAFETY: `second` outlives `mem2` (dropped first, below) and is not written meanwhile.
    let mem2 =
        unsafe { ForeignMemory::register_host(&owner, second.addr(), second.len()) }.unwrap();
    assert_eq!(
        reader
            .load_remote(&owner.local_metadata().unwrap())
            .unwrap(),
        remote
    );
    let op = [ReadOp {
        remote_addr: mem2.addr() + 5,
        len: 4096,
        local_offset: 0,
    }];
    reader
        .read(&remote, &op, &mut dst, &ReadOptions::default())
        .unwrap();
    assert_eq!(&dst.as_slice()[..4096], &second.as_slice()[5..5 + 4096]);
    drop(mem2);
    drop(mem1);

    // Refused before NIXL sees them.
    // SAFETY: every call below fails its range check before anything is registered.
    unsafe {
        for (addr, len) in [(first.as_ptr() as u64, 0), (0, 16), (u64::MAX - 8, 16)] {
            assert!(matches!(
                ForeignMemory::register_host(&owner, addr, len),
                Err(Error::BadLength { .. })
            ));
        }
    }
}
