//! A sparse model's table on the parameter servers, on the wire (ps-lite's push and pull on
//! keys): each shard owns a contiguous range of the table's rows; a step pushes the gradients
//! of the rows its batch named and pulls the rows the next batch names, each shard its own, as
//! one PushRows and one PullRows call per shard beside the dense exchange ([`RowsStep`]). Ids
//! travel as little-endian u32 counted from the shard's first row, values as f32, `dim` a row.
//! (What a worker keeps of the table between steps is in `table.rs`, above the client.)

use std::ops::Range;

use gradsync_proto::pb::{PullRowsRequest, RowChunk};

use super::bulk::Opts;
use super::connect::{Shard, deadline, request};
use super::error::{PsError, Result};

/// The rows one step moves, every id counted in the whole table and ascending.
pub struct RowsStep<'a> {
    /// The rows the batch named, and their gradients (`dim` values each).
    pub push: (&'a [u32], &'a [f32]),
    /// The rows to fetch (of the version the step makes), and where their values go.
    pub pull: (&'a [u32], &'a mut [f32]),
}

/// The part of `ids` (ascending) that falls in `rows`.
pub(super) fn within(ids: &[u32], rows: &Range<usize>) -> Range<usize> {
    ids.partition_point(|&i| (i as usize) < rows.start)..ids.partition_point(|&i| (i as usize) < rows.end)
}

/// Little-endian bytes of `ids` counted from `first`.
fn wire_ids(ids: &[u32], first: usize) -> bytes::Bytes {
    ids.iter().flat_map(|&i| (i - first as u32).to_le_bytes()).collect::<Vec<u8>>().into()
}

fn wire_values(v: &[f32]) -> bytes::Bytes {
    v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>().into()
}

/// Push shard `s`'s part of `ids` (global, ascending, all within its rows) and their `values`
/// as one PushRows call, computed from version `base`; always at least one chunk (an empty
/// one when the batch named none of its rows: the step waits for every rank's rows). Returns
/// the payload bytes.
pub(super) async fn push_rows(
    o: &Opts<'_>,
    s: &Shard,
    dim: usize,
    base: u64,
    ids: &[u32],
    values: &[f32],
) -> Result<u64> {
    let per = (s.chunk / (4 * dim.max(1))).max(1);
    let mut chunks: Vec<RowChunk> = ids
        .chunks(per)
        .zip(values.chunks(per * dim))
        .map(|(ids, v)| RowChunk {
            rank: o.rank,
            version: base,
            ids: wire_ids(ids, s.rows.start),
            data: wire_values(v),
        })
        .collect();
    if chunks.is_empty() {
        chunks.push(RowChunk { rank: o.rank, version: base, ..RowChunk::default() });
    }
    let bytes = chunks.iter().map(|c| (c.ids.len() + c.data.len()) as u64).sum();
    let mut client = s.rpc.client.clone();
    deadline(o.timeout, s.at(), "PushRows", client.push_rows(request(tokio_stream::iter(chunks), o.timeout)))
        .await?;
    Ok(bytes)
}

/// Pull rows `ids` (global, ascending, within `s`'s rows; every row of the shard with `None`)
/// of `version` (under BSP the server's or the next; `None`: its current) into `out`, `dim`
/// values a row in order. Returns the version and the payload bytes.
pub(super) async fn pull_rows(
    o: &Opts<'_>,
    s: &Shard,
    dim: usize,
    version: Option<u64>,
    ids: Option<&[u32]>,
    out: &mut [f32],
) -> Result<(u64, u64)> {
    let want: Vec<u32> = match ids {
        Some(ids) => ids.to_vec(),
        None => (s.rows.start as u32..s.rows.end as u32).collect(),
    };
    if out.len() != want.len() * dim {
        return Err(PsError::Invalid {
            what: "a pull of rows",
            why: format!("{} rows of {dim} values into {} values", want.len(), out.len()),
        });
    }
    let req = PullRowsRequest {
        rank: o.rank,
        version,
        ids: if ids.is_some() { wire_ids(&want, s.rows.start) } else { bytes::Bytes::new() },
        all: ids.is_none(),
    };
    let mut client = s.pull.client.clone();
    let fut = async {
        let mut stream = client.pull_rows(request(req, o.timeout)).await?.into_inner();
        let (mut at, mut bytes, mut seen) = (0usize, 0u64, None);
        while let Some(c) = stream.message().await? {
            bytes += (c.ids.len() + c.data.len()) as u64;
            if *seen.get_or_insert(c.version) != c.version {
                return Err(tonic::Status::data_loss("rows of two versions in one pull"));
            }
            let n = c.ids.len() / 4;
            if c.ids.len() % 4 != 0 || c.data.len() != n * dim * 4 || at + n > want.len() {
                return Err(tonic::Status::data_loss(format!(
                    "a chunk of {n} rows that does not fit the pull"
                )));
            }
            for (k, b) in c.ids.chunks_exact(4).enumerate() {
                let id = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize + s.rows.start;
                if id != want[at + k] as usize {
                    return Err(tonic::Status::data_loss(format!(
                        "row {id} where row {} was asked for",
                        want[at + k]
                    )));
                }
            }
            for (dst, b) in out[at * dim..(at + n) * dim].iter_mut().zip(c.data.chunks_exact(4)) {
                *dst = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            at += n;
        }
        if at != want.len() {
            return Err(tonic::Status::data_loss(format!("{at} of {} rows arrived", want.len())));
        }
        Ok((seen.unwrap_or(version.unwrap_or(s.version)), bytes))
    };
    deadline(o.timeout, s.at(), "PullRows", fut).await
}
