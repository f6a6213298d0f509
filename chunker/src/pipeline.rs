use std::sync::mpsc;

/// Runs `produce` on a helper thread up to `depth` items ahead of `consume`, so reads
/// overlap processing while memory stays bounded to `depth + 2` items.
///
/// `produce` gets back items `consume` has finished with (to reuse their buffers) and
/// returns `None` at the end. The first error on either side stops both and is returned.
pub fn read_ahead<T: Send, E: Send>(
    depth: usize,
    mut produce: impl FnMut(Option<T>) -> Option<Result<T, E>> + Send,
    mut consume: impl FnMut(&mut T) -> Result<(), E>,
) -> Result<(), E> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Result<T, E>>(depth.max(1));
    let (empty_tx, empty_rx) = mpsc::channel::<T>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            loop {
                let recycled = empty_rx.try_recv().ok();
                match produce(recycled) {
                    None => break,
                    Some(item) => {
                        let failed = item.is_err();
                        // The consumer hung up (it failed): stop reading.
                        if full_tx.send(item).is_err() || failed {
                            break;
                        }
                    }
                }
            }
        });
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
}
