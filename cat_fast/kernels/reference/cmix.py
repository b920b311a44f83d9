"""CMIX (docs/METHODS.md §1.1): h_mix[i] = lam_i * h[partner[i]] + (1 - lam_i) * h[i]."""


def mix_mask(mask, partner, mode):
    """Attention mask of the mixed sequence: the mask of i (`self`), of its partner, their union or intersection."""
    if mask is None:
        return None
    if mode == "self":
        return mask.clone()
    other = mask.index_select(0, partner)
    if mode == "partner":
        return other
    mine, theirs = mask != 0, other != 0
    mixed = (mine | theirs) if mode == "union" else (mine & theirs)
    return mixed.to(mask.dtype)


def cmix(h, lam, partner, mask=None, mask_mode="self"):
    lam_btd = lam.reshape(lam.shape[0], -1, 1) if lam.dim() == 2 else lam.reshape(-1, 1, 1)
    h_mix = lam_btd * h.index_select(0, partner) + (1 - lam_btd) * h
    return h_mix.to(h.dtype), mix_mask(mask, partner, mask_mode)
