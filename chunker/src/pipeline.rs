use std::sync::mpsc;

/// Runs `produce` on a helper thread up to `depth` items ahead of `consume`, so reads
/// overlap processing while memory stays bounded to `depth + 2` items.
///
/// `produce` gets back items `consume` has finished with (to reuse their buffers) and
/// returns `None` at the end. The first error on either side stops both and is returned.
pub fn read_ahead<T: Send, E: Send>(
    depth: usize,
    produce: impl FnMut(Option<T>) -> Option<Result<T, E>> + Send,
    mut consume: impl FnMut(&mut T) -> Result<(), E>,
) -> Result<(), E> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Result<T, E>>(depth.max(1));
    let (empty_tx, empty_rx) = mpsc::channel::<T>();
    std::thread::scope(|scope| {
        scope.spawn(move || produce_into(produce, empty_rx, full_tx));
        // Own the receiver here so an early return drops it, which unblocks the producer.
        let full_rx = full_rx;
        for item in full_rx.iter() {
            let mut item = item?;
            consume(&mut item)?;
            let _ = empty_tx.send(item);
        }
        Ok(())
    })
}

/// Like [`read_ahead`], with a middle stage on a thread of its own and `readers` reader
/// threads taking turns: item `k` is made by `read(k, recycled)` on reader `k % readers`
/// (`None`: there is no item `k`, the end), up to `depth` items ahead; `process` runs on
/// the items in order, up to `depth` items ahead of `consume`. So a copy reads the next
/// windows while it hashes this one and writes the one before (with [`read_ahead`]
/// alone, the device sits idle while a window is hashed), and two readers keep the
/// device busy while one of them waits for the last piece of its window. Memory stays
/// bounded to `readers × (depth + 1) + depth + 2` items; the first error on any stage
/// stops them all.
pub fn read_process_ahead<T: Send, E: Send>(
    depth: usize,
    readers: usize,
    read: impl Fn(usize, Option<T>) -> Option<Result<T, E>> + Sync,
    mut process: impl FnMut(&mut T) -> Result<(), E> + Send,
    consume: impl FnMut(&mut T) -> Result<(), E>,
) -> Result<(), E> {
    read_in_turns(depth, readers, read, |mut turns| {
        read_ahead(
            depth,
            move |recycled: Option<T>| {
                if let Some(item) = recycled {
                    // It was item k - 1 - depth or so: any reader may reuse it.
                    turns.recycle(item);
                }
                // A reader that hung up made its last item: the end.
                let mut item = match turns.next()? {
                    Ok(item) => item,
                    Err(e) => return Some(Err(e)),
                };
                Some(process(&mut item).map(|()| item))
            },
            consume,
        )
    })
}

/// The reader stage of [`read_process_ahead`] on its own, for a caller with later stages
/// of its own: `readers` reader threads take turns, item `k` made by `read(k, recycled)`
/// on reader `k % readers` (`None`: there is no item `k`, the end), each reader up to
/// `depth` items ahead of the one `body` takes next. `body` runs on this thread and takes
/// the items in order from its [`Turns`]; once it returns (and drops them), a reader
/// waiting to hand over an item stops, and this returns what `body` did. A reader stops
/// after its first error. Memory stays bounded to `readers × (depth + 1)` items besides
/// those `body` holds.
pub fn read_in_turns<T: Send, E: Send, R>(
    depth: usize,
    readers: usize,
    read: impl Fn(usize, Option<T>) -> Option<Result<T, E>> + Sync,
    body: impl FnOnce(Turns<T, E>) -> R,
) -> R {
    let readers = readers.max(1);
    let read = &read;
    std::thread::scope(|scope| {
        // Per reader: its items out, and the items given back for it to reuse.
        let mut outs = Vec::new();
        let mut recycle = Vec::new();
        for first in 0..readers {
            // Depth 0: a reader holds its one item until it is taken (a rendezvous).
            let (read_tx, read_rx) = mpsc::sync_channel::<Result<T, E>>(depth);
            let (empty_tx, empty_rx) = mpsc::channel::<T>();
            let mut k = first;
            let turn = move |recycled| {
                let item = read(k, recycled);
                k += readers;
                item
            };
            scope.spawn(move || produce_into(turn, empty_rx, read_tx));
            outs.push(read_rx);
            recycle.push(empty_tx);
        }
        body(Turns {
            outs,
            recycle,
            next: 0,
        })
    })
}

/// The items of [`read_in_turns`]' readers, in order: an iterator of each item or the
/// error that stopped its reader. It ends (`None`) where the reader whose turn it is has
/// hung up: it made its last item, or it died. Dropping it stops the readers.
pub struct Turns<T, E> {
    /// Per reader: its items.
    outs: Vec<mpsc::Receiver<Result<T, E>>>,
    /// Per reader: the items given back for it to reuse.
    recycle: Vec<mpsc::Sender<T>>,
    /// The number of the next item.
    next: usize,
}

impl<T, E> Turns<T, E> {
    /// Gives `item` back to be reused by the reader of the next item.
    pub fn recycle(&self, item: T) {
        let _ = self.recycle[self.next % self.recycle.len()].send(item);
    }
}

impl<T, E> Iterator for Turns<T, E> {
    type Item = Result<T, E>;

    fn next(&mut self) -> Option<Result<T, E>> {
        let item = self.outs[self.next % self.outs.len()].recv().ok()?;
        self.next += 1;
        Some(item)
    }
}

/// Sends what `produce` makes (given back items from `recycled` to reuse) to `out`, until
/// it makes nothing more, fails, or the receiving stage hangs up (it failed).
fn produce_into<T, E>(
    mut produce: impl FnMut(Option<T>) -> Option<Result<T, E>>,
    recycled: mpsc::Receiver<T>,
    out: mpsc::SyncSender<Result<T, E>>,
) {
    while let Some(item) = produce(recycled.try_recv().ok()) {
        let failed = item.is_err();
        if out.send(item).is_err() || failed {
            break;
        }
    }
}

/// Applies `f` to every item on up to `lanes` threads at once, the items dealt out in
/// turn and each thread taking its share in order; returns the results in the items'
/// order. For blocking reads: one request at a time leaves the device idle between them.
pub(crate) fn in_lanes<I: Send, R: Send>(
    items: Vec<I>,
    lanes: usize,
    f: impl Fn(I) -> R + Sync,
) -> Vec<R> {
    let lanes = lanes.clamp(1, items.len().max(1));
    let mut per_lane: Vec<Vec<(usize, I)>> = (0..lanes).map(|_| Vec::new()).collect();
    for (n, item) in items.into_iter().enumerate() {
        per_lane[n % lanes].push((n, item));
    }
    let f = &f;
    let mut results: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = per_lane
            .into_iter()
            .map(|lane| {
                scope.spawn(move || {
                    lane.into_iter()
                        .map(|(n, item)| (n, f(item)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a lane thread panicked"))
            .collect()
    });
    results.sort_by_key(|(n, _)| *n);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivers_in_order_and_stops_on_errors() {
        let mut n = 0;
        let mut seen = vec![];
        read_ahead(
            2,
            |_| {
                n += 1;
                (n <= 100).then_some(Ok::<_, String>(n))
            },
            |x| {
                seen.push(*x);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, (1..=100).collect::<Vec<_>>());

        let mut n = 0;
        let err = read_ahead(
            2,
            |_| {
                n += 1;
                Some(if n == 5 {
                    Err("read failed".to_string())
                } else {
                    Ok(n)
                })
            },
            |_| Ok(()),
        );
        assert_eq!(err, Err("read failed".to_string()));

        let err = read_ahead(
            2,
            |_| Some(Ok::<_, String>(1)),
            |_| Err("write failed".to_string()),
        );
        assert_eq!(err, Err("write failed".to_string()));
    }

    #[test]
    fn three_stages_deliver_in_order_recycle_and_stop_on_any_error() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        for readers in [1, 2, 3] {
            let fresh = AtomicUsize::new(0);
            let mut seen = vec![];
            read_process_ahead(
                1,
                readers,
                |k, recycled: Option<Vec<u32>>| {
                    let n = k as u32 + 1;
                    let mut item = recycled.unwrap_or_else(|| {
                        fresh.fetch_add(1, Relaxed);
                        Vec::new()
                    });
                    item.clear();
                    item.push(n);
                    (n <= 100).then_some(Ok::<_, String>(item))
                },
                |item| {
                    item.push(item[0] * 2);
                    Ok(())
                },
                |item| {
                    seen.push((item[0], item[1]));
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(seen, (1..=100).map(|i| (i, 2 * i)).collect::<Vec<_>>());
            let bound = readers * 2 + 3;
            let made = fresh.load(Relaxed);
            assert!(
                made <= bound,
                "{readers} readers: {made} items made, at most {bound}"
            );
        }

        for readers in [1, 2] {
            for failing_stage in 0..3 {
                let fail_at = |stage: usize, x: u32| match stage == failing_stage && x == 5 {
                    true => Err(format!("stage {stage} failed")),
                    false => Ok(()),
                };
                let err = read_process_ahead(
                    2,
                    readers,
                    |k, _| {
                        let n = k as u32 + 1;
                        Some(fail_at(0, n).map(|()| n))
                    },
                    |x| fail_at(1, *x),
                    |x| fail_at(2, *x),
                );
                assert_eq!(err, Err(format!("stage {failing_stage} failed")));
            }
        }
    }

    #[test]
    fn turns_deliver_in_order_end_and_stop_the_readers_when_dropped() {
        for readers in [1, 3] {
            // Every item, in order, then the end.
            let all: Vec<_> = read_in_turns(
                1,
                readers,
                |k, _: Option<usize>| (k < 50).then_some(Ok::<_, String>(k)),
                |turns| turns.collect::<Result<Vec<_>, _>>(),
            )
            .unwrap();
            assert_eq!(all, (0..50).collect::<Vec<_>>());

            // A body that stops early returns although the readers would go on forever.
            let first = read_in_turns(
                1,
                readers,
                |k, _: Option<usize>| Some(Ok::<_, String>(k)),
                |turns| turns.take(5).collect::<Result<Vec<_>, _>>(),
            )
            .unwrap();
            assert_eq!(first, vec![0, 1, 2, 3, 4]);

            // A reader's error arrives in its turn.
            let seen: Vec<_> = read_in_turns(
                1,
                readers,
                |k, _: Option<usize>| {
                    Some(if k == 7 {
                        Err(format!("read {k} failed"))
                    } else {
                        Ok(k)
                    })
                },
                |turns| turns.take(8).collect(),
            );
            assert_eq!(seen[..7], (0..7).map(Ok).collect::<Vec<_>>()[..]);
            assert_eq!(seen[7], Err("read 7 failed".to_string()));
        }
    }
}
