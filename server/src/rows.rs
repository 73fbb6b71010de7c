//! A sparse model's table on a parameter server (ps-lite's sparse KV): the rows this shard
//! owns and their momentum, updated in place and lazily. A push names rows by id with their
//! gradients; a step changes only the rows whose summed gradient is nonzero, their momentum
//! too (`optim::sgd_row`, the rule of every mode), so its cost follows the rows pushed, not
//! the table; a pull reads rows by id. The ids on the wire are little-endian u32 counted from
//! the shard's first row, strictly ascending ([`decode`] checks them).

use gradsync_core::optim::{SgdConfig, sgd_row};

/// Why a chunk of rows was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowsError {
    /// Malformed: lengths, order or range (what was wrong).
    Bad(String),
    /// A value is NaN or Inf (which row, and the value).
    NonFinite(String),
}

impl std::fmt::Display for RowsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowsError::Bad(why) | RowsError::NonFinite(why) => f.write_str(why),
        }
    }
}

/// One push's rows: ids (counted from the shard's first row, ascending) and `dim` values each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    /// The row ids.
    pub ids: Vec<u32>,
    /// The values, row after row.
    pub values: Vec<f32>,
}

impl Rows {
    /// Append one chunk's rows, checking that its ids continue the ascending order and lie in
    /// a shard of `rows` rows, and that `data` holds `dim` finite values for each. The error
    /// says what was wrong.
    pub fn extend_from_wire(
        &mut self,
        ids: &[u8],
        data: &[u8],
        rows: usize,
        dim: usize,
    ) -> Result<(), RowsError> {
        let bad = |why: String| Err(RowsError::Bad(why));
        if !ids.len().is_multiple_of(4) {
            return bad(format!("{} bytes of row ids, not a whole number of u32", ids.len()));
        }
        let n = ids.len() / 4;
        if data.len() != n * dim * 4 {
            return bad(format!(
                "{n} row id(s) with {} bytes of values; {dim} f32 a row makes {}",
                data.len(),
                n * dim * 4
            ));
        }
        let mut last = self.ids.last().copied();
        for b in ids.chunks_exact(4) {
            let id = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if id as usize >= rows {
                return bad(format!("row id {id}: this shard holds {rows} rows"));
            }
            if last.is_some_and(|l| id <= l) {
                return bad(format!(
                    "row id {id} after {}: ids must be strictly ascending",
                    last.unwrap_or(0)
                ));
            }
            last = Some(id);
            self.ids.push(id);
        }
        let from = self.values.len();
        self.values.extend(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        if let Some(i) = self.values[from..].iter().position(|v| !v.is_finite()) {
            let row = self.ids[self.ids.len() - n + i / dim];
            return Err(RowsError::NonFinite(format!("row {row} holds {}", self.values[from + i])));
        }
        Ok(())
    }

    /// Rows in this push.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether it names none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Row ids as they travel: little-endian u32, ascending and below `rows` (the error says
/// which is not).
pub fn decode_ids(ids: &[u8], rows: usize) -> Result<Vec<u32>, RowsError> {
    let mut r = Rows::default();
    r.extend_from_wire(ids, &[], rows, 0)?;
    Ok(r.ids)
}

/// The rows of one shard.
#[derive(Debug, Clone, PartialEq)]
pub struct RowStore {
    dim: usize,
    params: Vec<f32>,
    momentum: Vec<f32>,
}

impl RowStore {
    /// A store of `params.len() / dim` rows with their momentum.
    pub fn new(dim: usize, params: Vec<f32>, momentum: Vec<f32>) -> Self {
        debug_assert_eq!(params.len(), momentum.len());
        RowStore { dim, params, momentum }
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.params.len().checked_div(self.dim).unwrap_or(0)
    }

    /// Every value, row after row, and the momentum (for a checkpoint).
    pub fn parts(&self) -> (&[f32], &[f32]) {
        (&self.params, &self.momentum)
    }

    /// The values of rows `ids` (checked by [`Rows::extend_from_wire`] or [`decode_ids`]),
    /// as little-endian bytes appended to `out`.
    pub fn read(&self, ids: &[u32], out: &mut Vec<u8>) {
        out.reserve(ids.len() * self.dim * 4);
        for &id in ids {
            let at = id as usize * self.dim;
            for v in &self.params[at..at + self.dim] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// One BSP step: each row any of `pushes` names (given in rank order) gets the sum of
    /// their gradients of it, the first rank's value then each later one added (as the dense
    /// step sums), and is stepped with `grad_scale` unless the sum is all zero. Returns how
    /// many rows changed.
    pub fn step_sum(&mut self, sgd: &SgdConfig, pushes: &[&Rows], grad_scale: f32) -> usize {
        // (row, push, index in the push), in row then rank order.
        let mut order: Vec<(u32, usize, usize)> = pushes
            .iter()
            .enumerate()
            .flat_map(|(k, p)| p.ids.iter().enumerate().map(move |(i, &id)| (id, k, i)))
            .collect();
        order.sort_unstable();
        let dim = self.dim;
        let mut sum = vec![0.0f32; dim];
        let mut changed = 0;
        let mut i = 0;
        while i < order.len() {
            let id = order[i].0;
            let (_, k, at) = order[i];
            sum.copy_from_slice(&pushes[k].values[at * dim..(at + 1) * dim]);
            i += 1;
            while i < order.len() && order[i].0 == id {
                let (_, k, at) = order[i];
                for (s, &v) in sum.iter_mut().zip(&pushes[k].values[at * dim..(at + 1) * dim]) {
                    *s += v;
                }
                i += 1;
            }
            changed += usize::from(self.step_row(sgd, id, &sum, grad_scale));
        }
        changed
    }

    /// One push applied on its own (ASP, SSP): each row it names stepped with `grad_scale`
    /// unless its gradient is all zero. Returns how many rows changed.
    pub fn step_one(&mut self, sgd: &SgdConfig, push: &Rows, grad_scale: f32) -> usize {
        let dim = self.dim;
        push.ids
            .iter()
            .enumerate()
            .filter(|&(i, &id)| self.step_row(sgd, id, &push.values[i * dim..(i + 1) * dim], grad_scale))
            .count()
    }

    fn step_row(&mut self, sgd: &SgdConfig, id: u32, grad: &[f32], grad_scale: f32) -> bool {
        let at = id as usize * self.dim..(id as usize + 1) * self.dim;
        sgd_row(sgd, &mut self.params[at.clone()], grad, &mut self.momentum[at], grad_scale)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn wire(ids: &[u32], values: &[f32]) -> (Vec<u8>, Vec<u8>) {
        (
            ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    fn rows(ids: &[u32], values: &[f32], dim: usize) -> Rows {
        let (i, v) = wire(ids, values);
        let mut r = Rows::default();
        r.extend_from_wire(&i, &v, 100, dim).unwrap();
        r
    }

    #[test]
    fn bad_rows_are_refused_naming_what_is_wrong() {
        let mut r = Rows::default();
        let (i, v) = wire(&[1, 5], &[0.0; 4]);
        r.extend_from_wire(&i, &v, 10, 2).unwrap();
        let (i, v) = wire(&[5], &[0.0; 2]);
        let e = r.clone().extend_from_wire(&i, &v, 10, 2).unwrap_err().to_string();
        assert!(e.contains("row id 5 after 5") && e.contains("ascending"), "{e}");
        let (i, v) = wire(&[10], &[0.0; 2]);
        assert!(r.clone().extend_from_wire(&i, &v, 10, 2).unwrap_err().to_string().contains("holds 10 rows"));
        let (i, v) = wire(&[7], &[0.0; 3]);
        assert!(
            r.clone()
                .extend_from_wire(&i, &v, 10, 2)
                .unwrap_err()
                .to_string()
                .contains("2 f32 a row makes 8")
        );
        assert!(
            r.clone()
                .extend_from_wire(&[1, 2, 3], &[], 10, 2)
                .unwrap_err()
                .to_string()
                .contains("3 bytes of row ids")
        );
        let (i, v) = wire(&[7, 8], &[0.0, 0.0, 1.0, f32::NAN]);
        assert_eq!(
            r.clone().extend_from_wire(&i, &v, 10, 2).unwrap_err(),
            RowsError::NonFinite("row 8 holds NaN".into())
        );
        assert_eq!(decode_ids(&wire(&[0, 3], &[]).0, 4).unwrap(), vec![0, 3]);
    }

    /// The sum over ranks in rank order, then the lazy step, against a dense reference: rows
    /// no push names, and rows whose sum is zero, keep their values and momentum.
    #[test]
    fn a_step_sums_rows_in_rank_order_and_leaves_untouched_rows() {
        let sgd = SgdConfig { lr: 0.5, momentum: 0.9, weight_decay: 0.01 };
        let dim = 2;
        let params: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
        let momentum: Vec<f32> = (0..10).map(|i| i as f32 * 0.01).collect();
        let mut store = RowStore::new(dim, params.clone(), momentum.clone());
        let a = rows(&[0, 2, 3], &[1.0, 2.0, 0.1, 0.2, 1.0, -1.0], dim);
        let b = rows(&[2, 3, 4], &[0.3, 0.4, -1.0, 1.0, 0.0, 0.0], dim);
        assert_eq!(store.step_sum(&sgd, &[&a, &b], 0.5), 2);
        // Dense reference: the summed gradient, rows 0 and 2 nonzero, row 3 sums to zero,
        // row 4 is zero, row 1 is named by nobody.
        let mut sum = [0.0f32; 10];
        for (r, k) in [(&a, 0), (&b, 1)] {
            for (i, &id) in r.ids.iter().enumerate() {
                for d in 0..dim {
                    let v = r.values[i * dim + d];
                    let s = &mut sum[id as usize * dim + d];
                    *s = if k == 0 { v } else { *s + v };
                }
            }
        }
        let (mut p, mut m) = (params.clone(), momentum.clone());
        for row in 0..5 {
            let at = row * dim..(row + 1) * dim;
            sgd_row(&sgd, &mut p[at.clone()], &sum[at.clone()], &mut m[at], 0.5);
        }
        assert_eq!(store.parts(), (&p[..], &m[..]));
        assert_eq!(&store.parts().0[2..4], &params[2..4], "row 1 untouched");
        assert_eq!(
            &store.parts().0[6..10],
            &params[6..10],
            "rows 3 (summing to zero) and 4 (zero) untouched"
        );
        let mut out = Vec::new();
        store.read(&[2, 0], &mut out);
        let back: Vec<f32> = out.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(back, [&p[4..6], &p[0..2]].concat());
        // One push alone (ASP) steps the same rows the same way as a sum of one.
        let mut one = RowStore::new(dim, params.clone(), momentum.clone());
        let mut alone = RowStore::new(dim, params, momentum);
        assert_eq!(one.step_one(&sgd, &a, 1.0), 3);
        assert_eq!(alone.step_sum(&sgd, &[&a], 1.0), 3);
        assert_eq!(one, alone);
    }
}
