//! The call tree (`simulate --builtin call-tree`): per-hop budgets multiply across the hops;
//! one allowance for the tree does not, whoever spends it.

use stormguard_sim::builtin;
use stormguard_sim::tree::{CallTree, run};

#[test]
fn per_hop_budgets_multiply_and_one_allowance_does_not() {
    let (name, text) = builtin::CALL_TREE;
    let r = run(&CallTree::parse(name, text).unwrap());
    let product = r.per_hop_product.unwrap();
    assert!((product - 1.728).abs() < 1e-9);
    let [hop, tree, ledger] = &r.policies[..] else { panic!("three policies") };
    // Per-hop budgets: every hop spends its 20 %, and they multiply.
    let at = |p: &stormguard_sim::tree::TreeResult| p.attempts_per_action[2];
    assert!((at(hop) - product).abs() < 0.02, "{hop:?}");
    assert!(hop.retries.iter().all(|&n| n > 0));
    // One allowance of 1.2 with the stand-down: only the hop above the dependency retries.
    assert!(at(tree) <= 1.2 + 1e-3, "{tree:?}");
    assert_eq!(&tree.retries[..2], &[0, 0], "{tree:?}");
    assert!(tree.refused["tree"] > 0 && tree.refused["pushback"] > 0);
    // The allowance alone (nothing passed up): the dependency still sees at most 1.2, but the
    // first hop spends it, re-running the whole chain below for each retry.
    // (Overdrawn a little where a hop below spent before the extras from above reached it.)
    assert!(at(ledger) <= 1.2 * 1.005, "{ledger:?}");
    assert!(ledger.retries[0] > 10 * ledger.retries[2], "{ledger:?}");
}

#[test]
fn same_seed_same_table() {
    let (name, text) = builtin::CALL_TREE;
    let sc = CallTree::parse(name, text).unwrap();
    assert_eq!(run(&sc), run(&sc));
}
