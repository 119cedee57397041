"""The comparison study (issue: "is it better?" with evidence): seed-paired verdicts on loss
curves (:mod:`verdict`) and the in-context linear-regression task (:mod:`icl`)."""
