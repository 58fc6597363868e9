//! Apply copies and staging segments as a plan emits them, merged on the fly: rows at constant
//! strides become one strided [`Copy`](struct@Copy) or [`Segment`].

use super::output::{Copy, Segment, Segments, SegmentsRepr};

/// Apply copies as a plan emits them, from rows appended one at a time: a row continuing the
/// previous one (same rank, contiguous at both ends) extends it, and rows of equal length at
/// constant (non-negative) strides form one strided [`Copy`](struct@Copy). Expanding the result
/// row by row gives exactly the list of contiguous copies merged the same way without strides.
pub(super) struct CopySink {
    out: Vec<Copy>,
    /// The last contiguous copy, still growing: (rank, staging, live, len).
    pending: Option<(usize, u64, u64, u64)>,
}

impl CopySink {
    pub(super) fn new(capacity: usize) -> CopySink {
        CopySink {
            out: Vec::with_capacity(capacity),
            pending: None,
        }
    }

    pub(super) fn push(&mut self, rank: usize, s: u64, l: u64, len: u64) {
        if let Some(p) = &mut self.pending {
            if p.0 == rank && p.1.wrapping_add(p.3) == s && p.2.wrapping_add(p.3) == l {
                p.3 = p.3.wrapping_add(len);
                return;
            }
            let p = *p;
            self.flush(p);
        }
        self.pending = Some((rank, s, l, len));
    }

    fn flush(&mut self, (rank, s, l, len): (usize, u64, u64, u64)) {
        if let Some(c) = self.out.last_mut() {
            if c.rank_index == rank && c.len == len {
                if c.count == 1 {
                    if let (Some(ds), Some(dl)) = (
                        s.checked_sub(c.staging_offset),
                        l.checked_sub(c.live_offset),
                    ) {
                        c.count = 2;
                        c.staging_stride = ds;
                        c.live_stride = dl;
                        return;
                    }
                } else if c.row(c.count - 1).is_some_and(|(ps, pl)| {
                    ps.checked_add(c.staging_stride) == Some(s)
                        && pl.checked_add(c.live_stride) == Some(l)
                }) {
                    c.count += 1;
                    return;
                }
            }
        }
        self.out.push(Copy::single(rank, s, l, len));
    }

    /// As `count` calls of [`CopySink::push`], row `i` at staging `s + i * ss` and live
    /// `l + i * ls` (wrapping): row by row until the rows settle into one strided copy, then the
    /// rest at once.
    pub(super) fn push_rows(
        &mut self,
        rank: usize,
        (s, ss): (u64, u64),
        (l, ls): (u64, u64),
        len: u64,
        count: u64,
    ) {
        let row = |i: u64| {
            (
                s.wrapping_add(i.wrapping_mul(ss)),
                l.wrapping_add(i.wrapping_mul(ls)),
            )
        };
        let last = count.saturating_sub(1);
        // Every row without overflow (then each row extends the strided copy the previous
        // ones formed), and rows that do not merge into one contiguous run.
        let regular = !(ss == len && ls == len)
            && last
                .checked_mul(ss)
                .and_then(|d| s.checked_add(d))
                .is_some()
            && last
                .checked_mul(ls)
                .and_then(|d| l.checked_add(d))
                .is_some();
        let mut i = 0;
        while i < count {
            let (si, li) = row(i);
            self.push(rank, si, li, len);
            i += 1;
            if regular && i >= 3 && i < count && self.pending == Some((rank, si, li, len)) {
                let (sp, lp) = row(i - 2);
                if let Some(c) = self.out.last_mut() {
                    if c.rank_index == rank
                        && c.len == len
                        && c.count >= 2
                        && c.staging_stride == ss
                        && c.live_stride == ls
                        && c.row(c.count - 1) == Some((sp, lp))
                    {
                        // Rows i..=last each flush the previous one into `c`.
                        c.count += count - i;
                        let (sl, ll) = row(last);
                        self.pending = Some((rank, sl, ll, len));
                        return;
                    }
                }
            }
        }
    }

    pub(super) fn finish(mut self) -> Vec<Copy> {
        if let Some(p) = self.pending.take() {
            self.flush(p);
        }
        self.out
    }
}

/// Segments from runs appended one at a time: a run continuing the previous one extends it,
/// runs of equal length at a constant (non-negative) stride form one [`Segment`]. Expanding the
/// result gives exactly the runs merged the same way without strides.
#[derive(Default)]
pub(super) struct SegmentSink {
    out: Vec<Segment>,
    /// The last contiguous run, still growing: (offset, len).
    pending: Option<(u64, u64)>,
}

impl SegmentSink {
    pub(super) fn push(&mut self, o: u64, len: u64) {
        if let Some(p) = &mut self.pending {
            if p.0.wrapping_add(p.1) == o {
                p.1 = p.1.wrapping_add(len);
                return;
            }
            let p = *p;
            self.flush(p);
        }
        self.pending = Some((o, len));
    }

    fn flush(&mut self, (o, len): (u64, u64)) {
        if let Some(g) = self.out.last_mut() {
            if g.len == len {
                if g.count == 1 {
                    if let Some(d) = o.checked_sub(g.offset) {
                        g.count = 2;
                        g.stride = d;
                        return;
                    }
                } else if (g.count - 1)
                    .checked_mul(g.stride)
                    .and_then(|x| x.checked_add(g.offset))
                    .and_then(|x| x.checked_add(g.stride))
                    == Some(o)
                {
                    g.count += 1;
                    return;
                }
            }
        }
        self.out.push(Segment {
            offset: o,
            len,
            count: 1,
            stride: 0,
        });
    }

    /// As `count` calls of [`SegmentSink::push`], run `i` at `o + i * st` (wrapping), `len`
    /// bytes each: run by run until the runs settle into one strided segment, then the rest at
    /// once.
    pub(super) fn push_runs(&mut self, o: u64, st: u64, len: u64, count: u64) {
        let run = |i: u64| o.wrapping_add(i.wrapping_mul(st));
        let last = count.saturating_sub(1);
        let regular = st != len
            && last
                .checked_mul(st)
                .and_then(|d| o.checked_add(d))
                .is_some();
        let mut i = 0;
        while i < count {
            let oi = run(i);
            self.push(oi, len);
            i += 1;
            if regular && i >= 3 && i < count && self.pending == Some((oi, len)) {
                let prev = run(i - 2);
                if let Some(g) = self.out.last_mut() {
                    if g.len == len
                        && g.count >= 2
                        && g.stride == st
                        && (g.count - 1)
                            .checked_mul(g.stride)
                            .and_then(|x| x.checked_add(g.offset))
                            == Some(prev)
                    {
                        g.count += count - i;
                        self.pending = Some((run(last), len));
                        return;
                    }
                }
            }
        }
    }

    /// The segments; the sink is left empty for reuse (keeping its buffer when one segment is
    /// taken).
    pub(super) fn take(&mut self) -> Segments {
        if let Some(p) = self.pending.take() {
            self.flush(p);
        }
        if let [g] = self.out.as_slice() {
            let g = *g;
            self.out.clear();
            return Segments(SegmentsRepr::One(g));
        }
        Segments::from(std::mem::take(&mut self.out))
    }
}
