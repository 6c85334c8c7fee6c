"""Job spec files: defaults, the shipped specs, and one clear error naming the bad key."""

import os

import pytest

from weir.jobs.catalog.spec import SPECS_DIR, JobSpec, SpecError, load_spec, parse_spec, shipped_specs


def test_default_spec_reads_for_any_shop():
    spec = load_spec(None)
    assert spec == JobSpec()
    assert spec.domain.shop == "an online shop"
    assert "grocery" not in spec.describe.system_prompt
    assert (spec.taxonomy.source, spec.taxonomy.column, spec.classify.method) == ("column", "category", "exemplars")


def test_shipped_specs_load_by_name():
    assert sorted(os.listdir(SPECS_DIR)) == ["bigbasket.toml", "flipkart.toml"]
    flipkart = load_spec("flipkart")
    assert flipkart.path == os.path.join(SPECS_DIR, "flipkart.toml")
    assert (flipkart.columns.id, flipkart.columns.name) == ("uniq_id", "product_name")
    assert (flipkart.taxonomy.column, flipkart.taxonomy.json_list, flipkart.taxonomy.separator) == (
        "product_category_tree", True, ">>")
    assert flipkart.describe.sampling == load_spec(None).describe.sampling
    assert load_spec("bigbasket").taxonomy.hint_column == "sub_category"


def test_sampling_keeps_defaults_for_keys_not_given():
    spec = parse_spec({"describe": {"sampling": {"repetition_penalty": 1.3, "max_tokens": 80}}})
    assert spec.describe.sampling == dict(temperature=0.0, max_tokens=80, stop=["\n", ". ", "! ", "? "],
                                          include_stop_str_in_output=True, repetition_penalty=1.3)


def test_relative_taxonomy_file_is_resolved_against_the_spec(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[taxonomy]\nsource = "file"\nfile = "tax.txt"\n')
    assert load_spec(str(path)).taxonomy.file == str(tmp_path / "tax.txt")


@pytest.mark.parametrize("text, message", [
    ('[colums]\nid = "x"\n', "unknown table [colums]"),
    ('[columns]\nsku = "x"\n', "[columns] has unknown key 'sku'"),
    ('[columns]\nid = 5\n', "[columns] id must be a string, got 5"),
    ('[taxonomy]\njson_list = 1\n', "[taxonomy] json_list must be a boolean, got 1"),
    ('[taxonomy]\nlevel = "2"\n', "[taxonomy] level must be an integer, got '2'"),
    ('[taxonomy]\nlevel = 2.0\n', "[taxonomy] level must be an integer, got 2.0"),
    ('[taxonomy]\nsource = "web"\n', "[taxonomy] source must be one of column, file, got 'web'"),
    ('[taxonomy]\nsource = "file"\n', "[taxonomy] file must name a taxonomy file"),
    ('[taxonomy]\nlevel = 0\n', "[taxonomy] level must be >= 1, got 0"),
    ('[classify]\nnum_exemplars = 0\n', "[classify] num_exemplars must be >= 1, got 0"),
    ('[classify]\nvote_threshold = 1.5\n', "[classify] vote_threshold must be <= 1.0, got 1.5"),
    ('[classify]\nvote_threshold = nan\n', "[classify] vote_threshold must be a finite number, got nan"),
    ('[classify]\nreview_below = inf\n', "[classify] review_below must be a finite number, got inf"),
    ('[classify]\nnum_neighbours = 0\n', "[classify] num_neighbours must be >= 1, got 0"),
    ('[classify]\nmethod = "hybrid"\n', '[classify] method = "hybrid" needs vote_threshold above 0'),
    ('[classify]\nvote_threshold = 0.5\n',
     "[classify] vote_threshold does nothing under method = 'exemplars' (used by knn and hybrid)"),
    ('[classify]\nmethod = "zero_shot"\nnum_neighbours = 5\n',
     "[classify] num_neighbours does nothing under method = 'zero_shot' (used by knn and hybrid)"),
    ('[classify]\nmethod = "knn"\nreview_below = 0.9\n',
     "[classify] review_below does nothing under method = 'knn' (the model's probability: exemplars, "),
    ('[classify]\nmethod = "knn"\nnum_exemplars = 3\n',
     "[classify] num_exemplars does nothing under method = 'knn' (used by exemplars and hybrid)"),
    ('[describe.sampling]\nrepetition_penalt = 1.1\n', "[describe.sampling] has unknown key 'repetition_penalt'"),
    ('[describe.sampling]\nmax_tokens = 0\n', "[describe.sampling] max_tokens must be an integer >= 1, got 0"),
    ('[describe]\nsampling = 3\n', "[describe.sampling] must be a table"),
    ("[columns\n", "not valid TOML"),
    ('[extract.fields]\nbrand = "string"\n', "[extract.fields] must map each field name to its JSON Schema"),
    ('[extract.fields]\nsize = { type = "integer", multipleOf = 2 }\n',
     "[extract.fields] size: keyword 'multipleOf' at #/size is not supported"),
    ('[extract.fields]\nsize = { type = "integr" }\n',
     "[extract.fields] size: not a schema the grammar can enforce: Unsupported type \"integr\""),
    ('[extract.fields]\nbrand = "string"\n', "inline table such as { type = \"string\" }; brand is 'string'"),
    ('[extract.fields]\n"" = { type = "string" }\n', "[extract.fields] has an empty field name"),
    ('[extract.fields]\nbrand = { type = "string" }\n[[extract.examples]]\nname = "n"\nvalues = { colour = "red" }\n',
     "[[extract.examples]] #1 value 'colour' is not one of [extract.fields]"),
    ('[extract.fields]\nsize = { type = "integer" }\n[[extract.examples]]\nname = "n"\nvalues = { size = "L" }\n',
     "[[extract.examples]] #1 value size: 'L' is not of type 'integer'"),
    ('[extract.fields]\nsize = { type = "integer" }\n[[extract.examples]]\ndescription = "d"\n',
     "[[extract.examples]] #1 needs a name and a description"),
    ('[[extract.examples]]\nname = "n"\n', "[[extract.examples]] given without [extract.fields]"),
    ('[extract.sampling]\nstructured_outputs = "x"\n', "[extract.sampling] has unknown key 'structured_outputs'"),
    ('[extract.sampling]\nmax_tokens = 0\n', "[extract.sampling] max_tokens must be an integer >= 1, got 0"),
    ('[extract]\ndescription_chars = -1\n', "[extract] description_chars must be >= 0, got -1"),
])
def test_a_bad_spec_names_its_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(str(tmp_path / "none.toml"))


def test_extract_fields_become_a_nullable_required_schema_in_order(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[extract.fields]\nsize = { type = "integer", minimum = 1 }\nbrand = { type = "string" }\n'
                    '[[extract.examples]]\nname = "Acme Tea"\ndescription = "d"\nvalues = { brand = "Acme" }\n'
                    '[extract.sampling]\nmax_tokens = 64\n')
    extract = load_spec(str(path)).extract
    assert extract.enabled and not JobSpec().extract.enabled
    assert extract.schema == {"type": "object", "additionalProperties": False, "required": ["size", "brand"],
                              "properties": {"size": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
                                             "brand": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    assert extract.worked_examples() == [("Acme Tea", "d", {"size": None, "brand": "Acme"})]
    assert extract.sampling == {"temperature": 0.0, "max_tokens": 64, "logprobs": 0}


def test_shipped_specs_extract_the_fields_their_truth_has():
    assert list(load_spec("flipkart").extract.fields) == [
        "brand", "type", "color", "material", "ideal_for", "model_name", "pack_of"]
    assert list(load_spec("bigbasket").extract.fields) == ["brand", "quantity", "unit", "pack_size"]


def test_default_examples_keep_only_values_the_fields_accept():
    spec = parse_spec({"extract": {"fields": {"color": {"enum": ["Red", "Green"]}, "pack_of": {"type": "integer"},
                                              "fit": {"type": "string"}}}})
    assert [answer for _, _, answer in spec.extract.worked_examples()] == [
        {"color": None, "pack_of": 2, "fit": None}, {"color": None, "pack_of": None, "fit": None}]


def test_a_spec_that_is_not_utf_8_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "latin.toml"
    path.write_bytes(b'[domain]\nshop = "caf\xe9"\n')
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value) == f"{path}: not valid TOML, which is UTF-8 (byte offset 20: invalid continuation byte)"


def test_an_unknown_spec_name_lists_the_shipped_specs():
    assert shipped_specs() == ["bigbasket", "flipkart"]
    with pytest.raises(SpecError) as info:
        load_spec("nosuch")
    assert str(info.value) == ("no shipped spec 'nosuch' (shipped: bigbasket, flipkart); or give the path of a "
                               "TOML spec file (layout in jobs/catalog/spec.py)")


def test_enrich_help_names_the_shipped_specs():
    from weir.cli import build_parser
    from weir.jobs.catalog.commands import shipped_spec_names

    assert shipped_spec_names() == shipped_specs()
    enrich = build_parser()._subparsers._group_actions[0].choices["enrich"]
    spec_help = next(a.help for a in enrich._actions if "--spec" in a.option_strings)
    assert spec_help.startswith("job spec (TOML file, or a shipped spec: bigbasket, flipkart); ")


def test_extract_evidence_names_a_kind_per_field_of_the_spec():
    spec = parse_spec({"extract": {"fields": {"color": {"type": "string"}, "pack_of": {"type": "integer"}},
                                   "evidence": {"color": "colour", "pack_of": "count"}}})
    assert spec.extract.evidence == {"color": "colour", "pack_of": "count"}
    with pytest.raises(SpecError, match=r"\[extract.evidence\] 'size' is not one of \[extract.fields\]"):
        parse_spec({"extract": {"fields": {"color": {"type": "string"}}, "evidence": {"size": "count"}}})
    with pytest.raises(SpecError, match="colour"):
        parse_spec({"extract": {"fields": {"color": {"type": "string"}}, "evidence": {"color": "hue"}}})
    assert load_spec("flipkart").extract.evidence["pack_of"] == "count"
