"""Every field SGLang's own request structs carry is accepted at its SGLang default (the commit checked is
named in docs/engine-protocol.md). The field lists are data copied from SGLang's io_struct.py."""

from __future__ import annotations

import json

import pytest

from miles.engine import protocol as P

BASE = {"rid": None, "http_worker_ipc": None}  # SGLang's BaseReq

# struct -> {field: SGLang default (or a valid value for required fields)}
CONTROL = {
    P.AbortReq: {"rid": "", "http_worker_ipc": None, "abort_all": False, "finished_reason": None,
                 "abort_message": None, "weight_versions": None},
    P.PauseGenerationReqInput: {**BASE, "mode": "abort"},
    P.ContinueGenerationReqInput: {**BASE, "torch_empty_cache": True},
    P.FlushCacheReqInput: {**BASE, "timeout_s": None},
    P.MemoryOccupationReqInput: {**BASE, "tags": None},
    P.InitWeightsUpdateGroupReqInput: {**BASE, "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "group_name": "weight_update_group", "backend": "nccl"},
    P.DestroyWeightsUpdateGroupReqInput: {**BASE, "group_name": "weight_update_group"},
    P.UpdateWeightsFromDistributedReqInput: {**BASE, "names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                             "group_name": "weight_update_group", "flush_cache": True,
                                             "abort_all_requests": False, "weight_version": None,
                                             "load_format": None, "torch_empty_cache": False},
    P.UpdateWeightsFromTensorReqInput: {**BASE, "serialized_named_tensors": ["x"], "load_format": None,
                                        "flush_cache": True, "abort_all_requests": False, "weight_version": None,
                                        "disable_draft_model": None, "torch_empty_cache": False},
    P.UpdateWeightFromDiskReqInput: {**BASE, "model_path": "/m", "load_format": None, "abort_all_requests": False,
                                     "weight_version": None, "is_async": False, "torch_empty_cache": False,
                                     "keep_pause": False, "recapture_cuda_graph": False, "token_step": 0,
                                     "flush_cache": True, "manifest": None},
    P.UpdateWeightVersionReqInput: {**BASE, "new_version": "1", "abort_all_requests": True},
    P.GetWeightsByNameReqInput: {**BASE, "name": "w", "truncate_size": 100},
    # io_struct's LoRA requests; LoadLoRAAdapterFromTensorsReqInput also in its newer form (one serialized entry per
    # TP rank, upsert, expected_checksums), which Miles's client sends
    P.LoadLoRAAdapterReqInput: {**BASE, "lora_name": "a", "lora_path": "/a", "pinned": False, "lora_id": None},
    P.UnloadLoRAAdapterReqInput: {**BASE, "lora_name": "a", "lora_id": None},
    P.LoadLoRAAdapterFromTensorsReqInput: {**BASE, "lora_name": "a", "config_dict": {"r": 2},
                                           "serialized_tensors": "x", "serialized_named_tensors": None,
                                           "pinned": False, "added_tokens_config": None, "lora_id": None,
                                           "load_format": None, "upsert": False, "expected_checksums": None},
    P.LoadLoRAAdapterFromDistributedReqInput: {**BASE, "lora_name": "a", "config_dict": {"r": 2}, "names": ["x"],
                                               "dtypes": ["float32"], "shapes": [[2, 3]], "group_name": "g",
                                               "pinned": False, "added_tokens_config": None, "upsert": False,
                                               "lora_id": None},
}

GENERATE_FIELDS = (
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes "
    "use_audio_in_video video_config sampling_params return_logprob logprob_start_len top_logprobs_num "
    "token_ids_logprob return_sampling_mask return_text_in_logprobs return_flat_raw_top_logprobs "
    "return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states return_routed_experts "
    "routed_experts_start_len return_indexer_topk modalities session_params lora_path lora_id "
    "custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room "
    "bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank kv_router_hint "
    "routing_key conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority "
    "extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header "
    "received_time need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch min_dynamic_patch "
    "image_max_dynamic_patch video_max_dynamic_patch images_config multi_item_delimiter_indices cache_salt"
).split()


@pytest.mark.parametrize("cls", list(CONTROL), ids=lambda c: c.__name__)
def test_control_structs_accept_every_sglang_field(cls):
    body = CONTROL[cls]
    got = P.decode(json.dumps(body).encode(), cls)
    for name, value in body.items():
        assert getattr(got, name) == value, name
    with pytest.raises(P.BadRequest, match="unknown field `bogus`"):
        P.decode(json.dumps({**body, "bogus": 1}).encode(), cls)


def test_generate_accepts_every_sglang_field():
    missing = [f for f in GENERATE_FIELDS if f not in P.GenerateReqInput.__struct_fields__]
    assert not missing, missing
    body = {"input_ids": [1, 2], "return_sampling_mask": False, "cache_salt": "s", "kv_router_hint": None}
    specs, _ = P.normalize_generate(P.decode(json.dumps(body).encode(), P.GenerateReqInput), None, 100, lambda: "r")
    assert len(specs) == 1
    with pytest.raises(P.BadRequest, match="max_thinking_tokens is not supported"):
        P.normalize_generate(P.decode(b'{"input_ids": [1], "max_thinking_tokens": 5}', P.GenerateReqInput),
                             None, 100, lambda: "r")
