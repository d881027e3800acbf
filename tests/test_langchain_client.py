"""LangChain's ChatOpenAI, a client we did not write, against `omnirun serve` on the embedded model (random weights:
whatever parses below, the grammar made parse): plain and streamed calls, `with_structured_output` with a pydantic
model, and `bind_tools` with a forced tool choice."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("langchain_openai", reason="LangChain's OpenAI client: pip install langchain-openai")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'omnirun[structured]')")

from langchain_openai import ChatOpenAI  # noqa: E402

from omnirun.engine import LLM  # noqa: E402
from omnirun.server.app import create_app  # noqa: E402
from omnirun.server.testing import running_server  # noqa: E402


class Person(BaseModel):
    """Someone, as a form records them."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


class Book(BaseModel):
    """Book a table."""

    guests: int = Field(ge=1, le=12)


@pytest.fixture(scope="module")
def chat():
    with (
        LLM(device="cpu", dtype="float32", max_total_tokens=16384) as llm,
        running_server(create_app(llm, served_model_name="tiny")) as url,
    ):
        yield ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", temperature=0, max_tokens=300)


def test_invoke_and_stream_give_the_same_text(chat):
    whole = chat.invoke("Tell me a story.")
    streamed = "".join(chunk.content for chunk in chat.stream("Tell me a story."))
    assert whole.content and streamed == whole.content


def test_with_structured_output_returns_the_pydantic_object(chat):
    person = chat.with_structured_output(Person, method="json_schema").invoke("Describe a user.")
    assert isinstance(person, Person)
    assert len(person.name) <= 8 and 0 <= person.age <= 120


@pytest.mark.parametrize("tool_choice", ["GetWeather", "any"], ids=["named", "required"])
def test_bind_tools_with_a_forced_choice_returns_calls_whose_arguments_validate(chat, tool_choice):
    message = chat.bind_tools([GetWeather, Book], tool_choice=tool_choice).invoke("What is the weather in Paris?")
    assert message.tool_calls, message
    for call in message.tool_calls:
        model = {"GetWeather": GetWeather, "Book": Book}[call["name"]]
        model(**call["args"])  # pydantic validates the arguments against the tool's schema
    if tool_choice == "GetWeather":
        assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
