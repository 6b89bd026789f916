"""The real tokenizers of the model families disagg serves, built from the files
PyPI packages ship, converted to tokenizer.json the way Hugging Face converts
them, with their original implementations beside them as second references.

    llama3       llama-models' llama3/tokenizer.model (tiktoken ranks) ->
                 transformers' TikTokenConverter with Llama 3's pattern and its
                 256 specials; post-processor ByteLevel + TemplateProcessing
                 adding <|begin_of_text|>, as the hub's Llama-3.x tokenizer.json.
                 Original: llama_models.llama3.tokenizer.Tokenizer (tiktoken).
    mistral_v3   mistral-common's SentencePiece model v3 (32768, [INST] etc.)
                 -> transformers' LlamaTokenizer conversion (legacy=False:
                 Metaspace prepend_scheme "first"), byte_fallback, <s> template.
                 Original: sentencepiece.
    mistral_v1   the v1 model (Mistral-7B-v0.1) in the legacy form of the hub's
                 Mistral-7B-v0.1 / Llama-2 files: normalizer Prepend("▁") +
                 Replace(" ", "▁"), no pre-tokenizer.  Original: sentencepiece.
    mistral_v3_spm  the v3 model through transformers' SentencePiece-faithful
                 conversion (SpmConverter.build_tokenizer_from_spm_proto,
                 legacy: Replace(" ", "▁"), Replace(/^▁/ (\\A), "▁▁"), Metaspace
                 always, user-defined pieces split out, unk, ignore_merges),
                 which encodes exactly as sentencepiece does.
    tekken       mistral-common's tekken_240911.json -> transformers'
                 MistralConverter (byte-level BPE, the Tekken split pattern,
                 1000 specials), as the hub's Mistral-Nemo tokenizer.json.
                 Original: mistral_common's Tekkenizer (tiktoken).

Nothing is downloaded: the files come with the packages (scripts/setup.sh
installs them).  Conversion takes seconds; the outputs go to a caller's
directory (they are 2-20 MB: never committed).
"""
import json
import os
import shutil


def _save(tk, out_dir, config):
    os.makedirs(out_dir, exist_ok=True)
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def _bos_template(bos, bos_id):
    from tokenizers import processors
    return processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                      special_tokens=[(bos, bos_id)]),
    ])


class Llama3:
    name = "llama3"

    def __init__(self, out_dir):
        import llama_models.llama3.tokenizer as l3
        from transformers.convert_slow_tokenizer import TikTokenConverter
        self.orig = l3.Tokenizer.get_instance()
        model = os.path.join(os.path.dirname(l3.__file__), "tokenizer.model")
        specials = sorted(self.orig.special_tokens, key=self.orig.special_tokens.get)
        tk = TikTokenConverter(vocab_file=model, pattern=self.orig.pat_str,
                               extra_special_tokens=specials).converted()
        tk.post_processor = _bos_template("<|begin_of_text|>", self.orig.bos_id)
        _save(tk, out_dir, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "model_max_length": 131072})
        self.dir = out_dir
        self.specials = specials

    def orig_encode(self, s):
        """ids of the original, or None where it does not apply to s."""
        return self.orig.encode(s, bos=False, eos=False, allowed_special="all")

    def orig_decode(self, ids):
        return self.orig.decode(ids)


class MistralSpm:
    def __init__(self, out_dir, model_file, legacy_normalizer):
        import mistral_common
        import sentencepiece as spm
        from transformers import AutoTokenizer
        src = os.path.join(os.path.dirname(mistral_common.__file__), "data", model_file)
        work = out_dir + ".src"
        os.makedirs(work, exist_ok=True)
        shutil.copy(src, os.path.join(work, "tokenizer.model"))
        with open(os.path.join(work, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": False, "bos_token": "<s>",
                       "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                       "add_eos_token": False}, f)
        AutoTokenizer.from_pretrained(work).save_pretrained(out_dir)
        shutil.rmtree(work)
        if legacy_normalizer:  # the Llama-2 / Mistral-7B-v0.1 hub form
            path = os.path.join(out_dir, "tokenizer.json")
            with open(path, encoding="utf-8") as f:
                j = json.load(f)
            j["normalizer"] = {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
            j["pre_tokenizer"] = None
            with open(path, "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False)
        self.sp = spm.SentencePieceProcessor(model_file=src)
        self.dir = out_dir
        self.specials = [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())
                         if self.sp.is_control(i) or self.sp.is_unknown(i)]

    def orig_encode(self, s):
        # SentencePiece never matches control tokens in text
        if any(sp in s for sp in self.specials):
            return None
        return self.sp.encode(s)

    def orig_decode(self, ids):
        return self.sp.decode(ids)


class MistralV3(MistralSpm):
    name = "mistral_v3"

    def __init__(self, out_dir):
        super().__init__(out_dir, "mistral_instruct_tokenizer_240323.model.v3", False)


class MistralV1(MistralSpm):
    name = "mistral_v1"

    def __init__(self, out_dir):
        super().__init__(out_dir, "tokenizer.model.v1", True)


def spm_faithful(out_dir, model_file):
    """tokenizer.json of mistral-common's SentencePiece file model_file (a name in its data
    directory) through transformers' SentencePiece-faithful conversion; returns the proto."""
    import mistral_common
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    src = os.path.join(os.path.dirname(mistral_common.__file__), "data", model_file)
    proto = import_protobuf().ModelProto()
    with open(src, "rb") as f:
        proto.ParseFromString(f.read())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tk = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    # unknown (2) and control (3) pieces are the special tokens
    tk.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                           for p in proto.pieces if p.type in (2, 3)])
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", vocab["<s>"])])
    _save(tk, out_dir, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return src, proto


class MistralV3Spm(MistralSpm):
    name = "mistral_v3_spm"

    def __init__(self, out_dir):
        import sentencepiece as spm
        src, proto = spm_faithful(out_dir, "mistral_instruct_tokenizer_240323.model.v3")
        self.sp = spm.SentencePieceProcessor(model_file=src)
        self.dir = out_dir
        self.specials = [p.piece for p in proto.pieces if p.type in (2, 3)]


def mistral_data_dir():
    import mistral_common
    return os.path.join(os.path.dirname(mistral_common.__file__), "data")


def tekken_json(out_dir, src):
    """tokenizer.json of the Tekken file src through transformers' MistralConverter, with
    the <s> template; returns mistral-common's Tekkenizer of it."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers.integrations.mistral.tokenizer import MistralConverter
    tk = MistralConverter(vocab_file=src).converted()
    orig = Tekkenizer.from_file(src)
    bos = orig.id_to_piece(orig.bos_id)
    tk.post_processor = _bos_template(bos, orig.bos_id)
    _save(tk, out_dir, {"bos_token": bos, "eos_token": orig.id_to_piece(orig.eos_id)})
    return orig


class Tekken:
    name = "tekken"

    def __init__(self, out_dir):
        import mistral_common
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
        from transformers.integrations.mistral.tokenizer import MistralConverter
        src = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
        tk = MistralConverter(vocab_file=src).converted()
        self.orig = Tekkenizer.from_file(src)
        bos = self.orig.id_to_piece(self.orig.bos_id)
        tk.post_processor = _bos_template(bos, self.orig.bos_id)
        _save(tk, out_dir, {"bos_token": bos,
                            "eos_token": self.orig.id_to_piece(self.orig.eos_id)})
        self.dir = out_dir
        self.specials = [self.orig.id_to_piece(i) for i in range(self.orig.num_special_tokens)]

    def orig_encode(self, s):
        # Tekkenizer encodes special-token text as plain text
        if any(sp in s for sp in self.specials):
            return None
        return self.orig.encode(s, bos=False, eos=False)

    def orig_decode(self, ids):
        return self.orig.decode(ids)


FAMILIES = {c.name: c for c in (Llama3, MistralV3, MistralV1, MistralV3Spm, Tekken)}


def missing_packages():
    """The reference packages that cannot be imported (empty when all can)."""
    out = []
    for mod, pkg in (("tokenizers", "tokenizers"), ("transformers", "transformers"),
                     ("tiktoken", "tiktoken"), ("sentencepiece", "sentencepiece"),
                     ("llama_models", "llama-models"), ("mistral_common", "mistral-common")):
        try:
            __import__(mod)
        except Exception:  # noqa: BLE001 - any import failure means unusable
            out.append(pkg)
    return out
