//! The conformance suite every [`RemoteTier`] runs: absent keys, batched
//! order, set-if-absent (first value stays, in one batch too, and says
//! what became of each item), empty batches, a large value byte for byte,
//! renewals answering what is held, deletions (after which a key can be
//! written again).

use crate::key::RemoteKey;
use crate::{Put, RemoteTier};

fn fail(what: &str) -> Result<(), String> {
    Err(format!("RemoteTier contract: {what}"))
}

/// Checks `store` against the trait's contract. Keys are derived from
/// `salt`, so a run against a shared store does not meet another run's
/// keys (pass a fresh salt each run).
pub fn check_remote_tier(store: &dyn RemoteTier, salt: u64) -> Result<(), String> {
    let key = |i: u64| RemoteKey((u128::from(salt) << 64) | u128::from(i));
    let err = |e: crate::RemoteError| format!("{}: {e}", store.describe());
    let (a, b, c) = (key(1), key(2), key(3));
    if store.get_many(&[a, b]).map_err(err)? != vec![None, None] {
        return fail("fresh keys must be absent");
    }
    if store.contains(&[a]).map_err(err)? != vec![false] {
        return fail("contains of a fresh key must be false");
    }
    let empty = store.get_many(&[]).map_err(err)?.len()
        + store.put_many(&[]).map_err(err)?.len()
        + store.touch_many(&[]).map_err(err)?.len()
        + store.remove_many(&[]).map_err(err)?;
    if empty != 0 {
        return fail("empty batches must answer nothing");
    }
    let wrote = store
        .put_many(&[(a, b"alpha".to_vec()), (c, b"gamma".to_vec())])
        .map_err(err)?;
    if wrote != vec![Put::Written, Put::Written] {
        return fail("two new keys must answer two writes");
    }
    let got = store.get_many(&[a, b, c]).map_err(err)?;
    if got != vec![Some(b"alpha".to_vec()), None, Some(b"gamma".to_vec())] {
        return fail("get_many must answer in order, absent keys as None");
    }
    if store.contains(&[c, b, a]).map_err(err)? != vec![true, false, true] {
        return fail("contains must answer in order");
    }
    if store.put_many(&[(a, b"other".to_vec())]).map_err(err)? != vec![Put::Held] {
        return fail("a key already held must answer held");
    }
    if store.get_many(&[a]).map_err(err)? != vec![Some(b"alpha".to_vec())] {
        return fail("set-if-absent must keep the first value");
    }
    let d = key(4);
    let twice = [(d, b"first".to_vec()), (d, b"second".to_vec())];
    if store.put_many(&twice).map_err(err)? != vec![Put::Written, Put::Held] {
        return fail("a key given twice in one batch is written once, then held");
    }
    if store.get_many(&[d]).map_err(err)? != vec![Some(b"first".to_vec())] {
        return fail("a key given twice in one batch keeps the first value");
    }
    let big: Vec<u8> = (0..(3 << 20) + 7).map(|i: u32| (i % 251) as u8).collect();
    let e = key(5);
    store.put_many(&[(e, big.clone())]).map_err(err)?;
    if store.get_many(&[e]).map_err(err)? != vec![Some(big)] {
        return fail("a 3 MiB value must come back byte for byte");
    }
    if store.touch_many(&[c, b, a]).map_err(err)? != vec![true, false, true] {
        return fail("touch_many must answer, in order, whether each key is held");
    }
    if store.get_many(&[a]).map_err(err)? != vec![Some(b"alpha".to_vec())] {
        return fail("a touch must keep the value");
    }
    if store.remove_many(&[a, b]).map_err(err)? != 1 {
        return fail("remove_many must count the keys it deleted");
    }
    if store.get_many(&[a, c]).map_err(err)? != vec![None, Some(b"gamma".to_vec())] {
        return fail("a removed key must be absent, the others kept");
    }
    if store.put_many(&[(a, b"again".to_vec())]).map_err(err)? != vec![Put::Written]
        || store.get_many(&[a]).map_err(err)? != vec![Some(b"again".to_vec())]
    {
        return fail("a removed key must be writable again");
    }
    store.remove_many(&[a, c, d, e]).map_err(err)?;
    Ok(())
}
