//! A sparse model's table on the parameter servers, as one worker moves it (ps-lite's push and
//! pull on keys): each shard owns a contiguous range of the table's rows; a step pushes the
//! gradients of the rows its batch named and pulls the rows the next batch names, each shard
//! its own, as PushRows and PullRows beside the dense exchange. Ids travel as little-endian
//! u32 counted from the shard's first row, values as f32, `dim` a row.

use std::ops::Range;

use anyhow::Context;
use gradsync_core::Engine;
use gradsync_core::net::RowsOf;
use gradsync_proto::pb::{PullRowsRequest, RowChunk};

use super::bulk::{Opts, Transfer};
use super::client::PsClient;
use super::connect::{Shard, deadline, request};

/// The rows one step moves, every id counted in the whole table and ascending.
pub struct RowsStep<'a> {
    /// The rows the batch named, and their gradients (`dim` values each).
    pub push: (&'a [u32], &'a [f32]),
    /// The rows to fetch (of the version the step makes), and where their values go.
    pub pull: (&'a [u32], &'a mut [f32]),
}

/// A worker's side of a table on parameter servers, between steps: each step pushes the
/// gradients of the rows its batch named and pulls the rows of the next batch (known ahead,
/// `Batch::next_x`), so the rows a forward pass reads are always of the version the
/// step before made. Used by `--mode ps` and `--mode hybrid` alike.
#[derive(Debug, Default)]
pub struct TableRows {
    dim: usize,
    /// The rows the next batch names.
    next: Vec<u32>,
    /// The rows whose values in the engine are of the current version (pulled for this batch).
    fresh: Option<Vec<u32>>,
    /// The rows this step's batch named, and their gradients.
    named: Vec<u32>,
    grads: Vec<f32>,
    pulled: Vec<f32>,
}

impl TableRows {
    /// For a table of rows of `dim` values.
    pub fn new(dim: usize) -> Self {
        TableRows { dim, ..TableRows::default() }
    }

    /// The batch after the coming one is `x`: its rows are pulled with the coming step's push.
    pub fn set_next(&mut self, engine: &Engine, x: &[f32]) -> anyhow::Result<()> {
        self.next = engine.rows_of(x)?;
        Ok(())
    }

    /// Make the engine's rows of batch `x` current before its forward pass, unless the step
    /// before pulled them (it does, except on the first step and after a step that could not
    /// look ahead). Returns the bytes pulled.
    pub async fn ensure(
        &mut self,
        client: &mut PsClient,
        engine: &mut Engine,
        x: &[f32],
    ) -> anyhow::Result<u64> {
        let want = engine.rows_of(x)?;
        if self.fresh.as_ref() == Some(&want) {
            return Ok(0);
        }
        self.pulled.resize(want.len() * self.dim, 0.0);
        let got = client.pull_rows(&want, &mut self.pulled).await?;
        engine.write_rows(RowsOf::Params, &want, &self.pulled)?;
        self.fresh = Some(want);
        Ok(got.bytes)
    }

    /// After backward: read the gradients of the rows the batch named, for the push. Returns
    /// how many rows that is.
    pub fn stage(&mut self, engine: &Engine) -> anyhow::Result<usize> {
        self.named.clear();
        self.named.extend_from_slice(engine.batch_rows());
        self.grads.resize(self.named.len() * self.dim, 0.0);
        engine.read_rows(RowsOf::Grads, &self.named, &mut self.grads)?;
        self.pulled.resize(self.next.len() * self.dim, 0.0);
        Ok(self.named.len())
    }

    /// The step's rows: the staged ones to push, the next batch's to pull.
    pub fn step(&mut self) -> RowsStep<'_> {
        RowsStep { push: (&self.named, &self.grads), pull: (&self.next, &mut self.pulled) }
    }

    /// After the exchange: the pulled rows into the engine's parameters.
    pub fn land(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        engine.write_rows(RowsOf::Params, &self.next, &self.pulled)?;
        self.fresh = Some(std::mem::take(&mut self.next));
        Ok(())
    }

    /// Clear the staged rows' gradients in the engine, so that its own update leaves them (the
    /// servers step the table; `--mode hybrid`, whose ranks update the rest locally).
    pub fn clear_named(&mut self, engine: &mut Engine) -> anyhow::Result<()> {
        self.grads.fill(0.0);
        engine.write_rows(RowsOf::Grads, &self.named, &self.grads)?;
        Ok(())
    }

    /// Every row of the table, of the servers' current version, into the engine.
    pub async fn sync(&mut self, client: &mut PsClient, engine: &mut Engine) -> anyhow::Result<Transfer> {
        let table = engine.layout().table.clone().context("a model with rows has a table")?;
        self.pulled.resize(table.range.len(), 0.0);
        let t = client.pull_all_rows(&mut self.pulled).await?;
        engine.write_params(table.range.start, &self.pulled)?;
        Ok(t)
    }
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
) -> anyhow::Result<u64> {
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
    deadline(
        o.timeout,
        &s.addr,
        "PushRows",
        client.push_rows(request(tokio_stream::iter(chunks), o.timeout)),
    )
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
) -> anyhow::Result<(u64, u64)> {
    let want: Vec<u32> = match ids {
        Some(ids) => ids.to_vec(),
        None => (s.rows.start as u32..s.rows.end as u32).collect(),
    };
    anyhow::ensure!(out.len() == want.len() * dim, "{} rows into {} values", want.len(), out.len());
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
    deadline(o.timeout, &s.addr, "PullRows", fut).await.context("pulling the table's rows")
}
